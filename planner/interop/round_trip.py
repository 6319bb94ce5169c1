"""Read an emitted configuration back as `--from-megatron` / `--from-torchtitan` would, price
it, and say what differs from the plan it was emitted for: `fxpar plan --emit` prints
"expressed exactly" only where nothing does."""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace

from planner.interop.configuration import Configuration
from planner.interop.emit import (ModelFacts, default_csv_path, nearest, pricer_of_args,
                                  write)
from planner.interop.expressible import fastest_expressible
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.search.plan import Plan


def emit_checked(target: str, plan: Plan, pricer, facts: ModelFacts,
                 csv_path: str | None = None, fix: dict | None = None) -> tuple[str, str | None]:
    """planner.interop.emit.emit, read back where it claims to be exact: the header then says
    whether the output prices the very plan, or what differs. With `fix` (the --fix `plan` was
    planned with), where the target cannot state `plan` the fastest layout it can state is
    planned and emitted instead (planner.interop.expressible)."""
    return _emitted(target, plan, pricer, facts, csv_path, fix)[:2]


def _emitted(target, plan, pricer, facts, csv_path, fix):
    """(text, CSV text or None, the CSV's path)."""
    expressed = (nearest(target, plan, lambda: pricer) if fix is None else
                 fastest_expressible(target, plan, pricer, fix))
    source = expressed.planned or plan  # the plan the configuration states
    csv_path = csv_path or default_csv_path(source)
    text, table = write(target, plan, expressed, facts, csv_path)
    if expressed.exact or expressed.planned is not None:  # what it says it states
        stated = plan if expressed.exact else expressed.priced.plan
        expressed.round_trip = read_back(target, text, stated, pricer, facts, table, csv_path)
        text, table = write(target, plan, expressed, facts, csv_path)
    return text, table, csv_path


def cmd_emit(args) -> int:
    """`fxpar plan --emit TARGET`: the plan `fxpar plan` prints for the same arguments, as the
    target's configuration (or the fastest the target can state), read back before it says
    "expressed exactly"."""
    pricer, facts = pricer_of_args(args)
    plan = pricer.best(fix=args.fix)[0]
    text, table, csv_path = _emitted(args.emit, plan, pricer, facts, args.emit_csv, args.fix)
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
        if table is not None:  # beside the TOML, which names it so (--emit-csv may be anywhere)
            name = os.path.basename(csv_path or "schedule.csv") or "schedule.csv"
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(table)
            text = text.replace(f'pipeline_parallel_schedule_csv = "{csv_path or ""}"',
                                f'pipeline_parallel_schedule_csv = "{name}"')
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return torchtitan_configuration(path, facts, pricer.gpus, pricer.seq,
                                        pricer.global_batch)


def differences(plan: Plan, back: Plan) -> str:
    """What of the configuration and sizes differs between two plans ('' when nothing). The
    order of a stage's blocks is not compared: a stated layout is priced by how many blocks of
    each strategy a stage holds (Pricer.price), which fixes neither time nor memory by order."""
    a, b = (replace(Configuration.of(p), stages=tuple(
        tuple(sorted(st)) for st in Configuration.of(p).stages)) for p in (plan, back))
    pairs = [(name, getattr(a, name), getattr(b, name)) for name in (
        "dp", "tp", "pp", "cp", "ep", "micro_batch", "schedule", "v", "zero", "dp_shard", "ends",
        "split_backward", "stages")]
    pairs += [("global batch", plan.global_batch, back.global_batch),
              ("seq", plan.seq, back.seq),
              ("micro-batches", plan.num_microbatches, back.num_microbatches)]
    def shown(name: str, x):
        return x or "retraverse" if name == "split_backward" else x
    return "; ".join(f"{name} {shown(name, x)} -> {shown(name, y)}" for name, x, y in pairs
                     if x != y)
