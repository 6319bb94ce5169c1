"""fxpar's planner, the top floor: `autoparallelize` and `plan`, the search over meshes and
schedules, the stage ILP, the frozen Plan with its text and JSON forms, explanations, the models
and Hugging Face bridge, training beside one process, and the `fxpar` command line.

Floors: planner → cost_model → passes → runtime; imports point downward only."""

__all__ = ["autoparallelize", "plan", "Plan"]


def __getattr__(name):  # lazy, so `fxpar --help` does not import torch
    if name in ("autoparallelize", "plan"):
        from planner import api
        return getattr(api, name)
    if name == "Plan":
        from planner.plan import Plan
        return Plan
    raise AttributeError(name)
