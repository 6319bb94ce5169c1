"""Read an emitted configuration back as `--from-megatron` / `--from-torchtitan` would, price
it, and say what differs from the plan it was emitted for: `fxpar plan --emit` prints
"expressed exactly" only where nothing does."""
from __future__ import annotations

import os
import tempfile

from planner.interop.configuration import Configuration
from planner.interop.emit import (ModelFacts, default_csv_path, nearest, pricer_of_args,
                                  write)
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.search.plan import Plan


def emit_checked(target: str, plan: Plan, pricer, facts: ModelFacts,
                 csv_path: str | None = None) -> tuple[str, str | None]:
    """planner.interop.emit.emit, read back where it claims to be exact: the header then says
    whether the output prices the very plan, or what differs."""
    expressed = nearest(target, plan, lambda: pricer)
    text, table = write(target, plan, expressed, facts, csv_path)
    if expressed.exact:
        expressed.round_trip = read_back(target, text, plan, pricer, facts, table, csv_path)
        text, table = write(target, plan, expressed, facts, csv_path)
    return text, table


def cmd_emit(args) -> int:
    """`fxpar plan --emit TARGET`: the plan `fxpar plan` prints for the same arguments, as the
    target's configuration, read back before it says "expressed exactly"."""
    pricer, facts = pricer_of_args(args)
    plan = pricer.best(fix=args.fix)[0]
    csv_path = args.emit_csv or default_csv_path(plan)
    text, table = emit_checked(args.emit, plan, pricer, facts, csv_path)
    if table is not None:
        with open(csv_path, "w", encoding="utf-8") as f:
            f.write(table)
    print(text)
    return 0


def read_back(target: str, text: str, plan: Plan, pricer, facts, table: str | None = None,
              csv_path: str | None = None) -> str:
    """'' where the emitted `text` (and its schedule CSV `table`), imported for `pricer`'s
    request and priced, is `plan`'s configuration; otherwise what differs (field: emitted plan
    -> read back)."""
    try:
        back = pricer.price(read(target, text, pricer, facts, table, csv_path).config).plan
    except ValueError as err:
        return f"it is refused ({err})"
    return differences(plan, back)


def read(target: str, text: str, pricer, facts, table: str | None = None,
         csv_path: str | None = None):
    """The emitted configuration as `--from-megatron` / `--from-torchtitan` read it (a TOML's
    schedule CSV written beside it, under the name the TOML gives)."""
    if target == "megatron":
        return megatron_configuration(text, facts, pricer.gpus, pricer.seq, pricer.global_batch)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "job.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if table is not None:
            with open(os.path.join(folder, os.path.basename(csv_path or "schedule.csv")), "w",
                      encoding="utf-8") as f:
                f.write(table)
        return torchtitan_configuration(path, facts, pricer.gpus, pricer.seq,
                                        pricer.global_batch)


def differences(plan: Plan, back: Plan) -> str:
    """What of the configuration and sizes differs between two plans ('' when nothing)."""
    a, b = Configuration.of(plan), Configuration.of(back)
    pairs = [(name, getattr(a, name), getattr(b, name)) for name in (
        "dp", "tp", "pp", "cp", "micro_batch", "schedule", "v", "zero", "dp_shard", "ends",
        "split_backward", "stages")]
    pairs += [("global batch", plan.global_batch, back.global_batch),
              ("seq", plan.seq, back.seq),
              ("micro-batches", plan.num_microbatches, back.num_microbatches)]
    def shown(name: str, x):
        return x or "retraverse" if name == "split_backward" else x
    return "; ".join(f"{name} {shown(name, x)} -> {shown(name, y)}" for name, x, y in pairs
                     if x != y)
