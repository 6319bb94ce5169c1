"""fxpar's planner: `autoparallelize`, the stage ILP, the search over meshes, and the Plan."""

__all__ = ["autoparallelize", "plan", "Plan"]


def __getattr__(name):  # lazy, so `fxpar --help` does not import torch
    if name in ("autoparallelize", "plan"):
        from planner import api
        return getattr(api, name)
    if name == "Plan":
        from planner.plan import Plan
        return Plan
    raise AttributeError(name)
