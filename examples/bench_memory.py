"""Measured saved-activation memory per pipeline stage, by schedule, against the schedule's count.

One training step of a small GPT on p gloo ranks per schedule, with the bytes autograd saves for
backward counted while alive (runtime.training.activation_memory). Per stage: the peak, the same peak counted in
micro-batches (peak / what one micro-batch's forward saves) and, to compare, the number of
micro-batches the schedule itself keeps in flight on that stage (F until B, or until W).

    python examples/bench_memory.py [--p 4] [--m 16]
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from passes.capture.trace import capture
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import make_optimizer
from runtime.pipeline.generators import make_schedule
from runtime.launch.ranks import run_local
from passes.stages.program import build_pipeline_trainer
from runtime.observe.measure import gather_memory
from runtime.comm.mesh import mesh_groups
from runtime.comm.mesh import Mesh
from runtime.pipeline.schedule import Kind, Schedule
from runtime.training.trainer import TrainOptions

CONFIG = get_config("gpt-tiny")
MICRO_BATCH = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def _schedule(name: str, p: int, m: int) -> Schedule:
    return make_schedule(name, p, m, 2 if name == "interleaved-1f1b" else 1)


def measure(p: int, m: int) -> dict:
    """Runs on every rank: per schedule, StageMemory of every stage."""
    torch.set_num_threads(1)
    config = CONFIG.with_(global_batch=MICRO_BATCH * m)
    batch = example_batch(config, config.global_batch)
    groups = mesh_groups(Mesh(p, 1, 1))
    result = {}
    for name in SCHEDULES:
        torch.manual_seed(0)
        captured = capture(build_model(config), tuple(x[:MICRO_BATCH] for x in batch))
        trainer = build_pipeline_trainer(captured, _schedule(name, p, m), groups, make_optimizer,
                                         TrainOptions(track_memory=True))
        trainer.step(*batch)
        result[name] = gather_memory(trainer)
    return result


def scheduled_in_flight(schedule: Schedule) -> dict[int, int]:
    """Most micro-batches alive at once per stage, replaying each rank's action order."""
    peak: dict[int, int] = {}
    for acts in schedule.actions:
        alive: dict[int, int] = {}
        for a in acts:
            if a.kind is Kind.F:
                alive[a.stage] = alive.get(a.stage, 0) + 1
            elif a.kind in (Kind.B, Kind.W):
                alive[a.stage] -= 1
            if a.stage in alive:
                peak[a.stage] = max(peak.get(a.stage, 0), alive[a.stage])
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=16)
    args = parser.parse_args()
    p, m = args.p, args.m
    print(f"{CONFIG.name} ({CONFIG.layers} blocks, hidden {CONFIG.hidden}, seq {CONFIG.seq}), "
          f"micro-batch {MICRO_BATCH}, p={p} ranks, m={m} micro-batches, fp32\n")
    memory = run_local(measure, p, (p, m), timeout_s=600)[0]
    rows = []
    for name in SCHEDULES:
        schedule = _schedule(name, p, m)
        expected = scheduled_in_flight(schedule)
        for stage, mem in memory[name].items():
            rows.append([name, stage, schedule.stage_to_rank(stage),
                         f"{mem.peak_bytes / 2**20:.2f}", f"{mem.microbatches:.2f}",
                         expected[stage]])
    print(tabulate(rows, headers=["schedule", "stage", "rank", "peak saved MiB",
                                  "micro-batches alive", "schedule keeps"]))
    ratio = memory["1f1b"][0].peak_bytes / memory["gpipe"][0].peak_bytes
    verdict = "holds" if ratio <= (p / m) * 1.10 else "FAILS"
    print(f"\nstage 0: 1F1B / GPipe = {ratio:.3f}; p/m = {p / m:.3f}; "
          f"acceptance (1F1B <= p/m x GPipe + 10%) {verdict}")


if __name__ == "__main__":
    main()
