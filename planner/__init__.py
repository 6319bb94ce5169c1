"""fxpar's planner, the top floor: `autoparallelize` and `plan` (api), the `fxpar` command line (cli),
and its subpackages —

  search/    the outer search over meshes and schedules, the stage ILP, ZeRO and expert axes, the Plan
  models/    reference presets, MoE and mixed decoders, the Hugging Face bridge
  weights/   meta-device models materialised per shard, safetensors per shard, export
  report/    explanations and pictures of a plan
  interop/   torchtitan / Megatron-LM configurations in and out
  training/  training a plan on local gloo ranks beside one process; resume under any plan;
             `fxpar train` (config, token files, schedule, metrics, torchrun launch)
  bench/     `fxpar bench` and the probes `fxpar calibrate` runs

Floors: planner → cost_model → passes → runtime; imports point downward only, and inside the
planner cli → bench → training → interop → api → weights → report → search → models
(tests/unit/test_floors.py)."""

__all__ = ["autoparallelize", "plan", "Plan"]


def __getattr__(name):  # lazy, so `fxpar --help` does not import torch
    if name in ("autoparallelize", "plan"):
        from planner import api
        return getattr(api, name)
    if name == "Plan":
        from planner.search.plan import Plan
        return Plan
    raise AttributeError(name)
