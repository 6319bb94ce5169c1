"""Read an emitted configuration back as `--from-megatron` / `--from-torchtitan` would, price
it, and say what differs from the plan it was emitted for: `fxpar plan --emit` prints
"expressed exactly" only where nothing does."""
from __future__ import annotations

import os
import tempfile

from planner.interop.configuration import Configuration
from planner.search.plan import Plan


def read_back(target: str, text: str, plan: Plan, pricer, facts) -> str:
    """'' where the emitted `text`, imported for `pricer`'s request and priced, is `plan`'s
    configuration; otherwise what differs (field: emitted plan -> read back)."""
    from planner.interop.from_megatron import megatron_configuration
    from planner.interop.from_torchtitan import torchtitan_configuration
    try:
        if target == "megatron":
            imp = megatron_configuration(text, facts, pricer.gpus, pricer.seq,
                                         pricer.global_batch)
        else:
            with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
                f.write(text)
            try:
                imp = torchtitan_configuration(f.name, facts, pricer.gpus, pricer.seq,
                                               pricer.global_batch)
            finally:
                os.unlink(f.name)
        back = pricer.price(imp.config).plan
    except ValueError as err:
        return f"it is refused ({err})"
    return differences(plan, back)


def differences(plan: Plan, back: Plan) -> str:
    """What of the configuration and sizes differs between two plans ('' when nothing)."""
    a, b = Configuration.of(plan), Configuration.of(back)
    pairs = [(name, getattr(a, name), getattr(b, name)) for name in (
        "dp", "tp", "pp", "cp", "micro_batch", "schedule", "v", "zero", "dp_shard", "ends",
        "stages")]
    pairs += [("global batch", plan.global_batch, back.global_batch),
              ("seq", plan.seq, back.seq),
              ("micro-batches", plan.num_microbatches, back.num_microbatches)]
    return "; ".join(f"{name} {x} -> {y}" for name, x, y in pairs if x != y)
