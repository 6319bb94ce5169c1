"""Measurement runs of the pipeline runtime: set up a trainer for a captured model and a schedule
on the current ranks, then gather what it measured (timelines, saved-activation peaks) and export
the measured timeline next to the simulated one."""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from runtime.pipeline.schedule import Action, Schedule
from runtime.pipeline.simulator import Timeline, simulate
from runtime.pipeline.timeline import plot_gantt, to_chrome_trace
from runtime.training.trainer import PipelineTrainer


def balanced_stage_sizes(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Contiguous layer counts, as equal as possible, the larger ones first."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (i < extra) for i in range(num_stages))


def gather_timeline(trainer: PipelineTrainer) -> Timeline:
    """The last step's measured compute actions of the whole pipeline (every rank of it gets
    it); ranks are pipeline indices, as in the schedule."""
    events = list(trainer.timeline().events)
    if trainer.groups.pp is None:
        return Timeline.from_events(events)
    parts: list = [None] * trainer.groups.mesh.pp
    dist.all_gather_object(parts, events, group=trainer.groups.pp)
    return Timeline.from_events(sorted((e for part in parts for e in part),
                                       key=lambda e: (e.rank, e.start)))


@dataclass(frozen=True)
class StageMemory:
    peak_bytes: int            # saved activations alive at the stage's peak
    microbatch_bytes: int      # what one forward of one micro-batch saves

    @property
    def microbatches(self) -> float:
        """Micro-batches whose activations were alive at the peak."""
        return self.peak_bytes / self.microbatch_bytes if self.microbatch_bytes else 0.0


def gather_memory(trainer: PipelineTrainer) -> dict[int, StageMemory]:
    """Saved-activation peaks of every stage of the pipeline (needs track_memory=True)."""
    if trainer.memory is None:
        raise ValueError("the trainer was built without TrainOptions(track_memory=True)")
    memory = trainer.memory
    mine = {s: StageMemory(memory.peak.get(s, 0), memory.last_forward.get(s, 0))
            for s in trainer.programs}
    if trainer.groups.pp is None:
        return mine
    parts: list = [None] * trainer.groups.mesh.pp
    dist.all_gather_object(parts, mine, group=trainer.groups.pp)
    return dict(sorted((s, m) for part in parts for s, m in part.items()))


def simulate_like(schedule: Schedule, measured: Timeline) -> Timeline:
    """The schedule simulated with each (stage, kind)'s median measured duration, so the two
    timelines differ only by what the simulation leaves out (communication, contention)."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in measured.events:
        samples[e.action.stage, e.action.kind.value].append(e.end - e.start)
    medians = {key: statistics.median(v) for key, v in samples.items()}

    def duration(action: Action) -> float:
        return medians.get((action.stage, action.kind.value), 0.0)

    return simulate(schedule, duration)


def export_timelines(measured: Timeline, simulated: Timeline, prefix: str | os.PathLike,
                     png: bool = True) -> list[str]:
    """Write <prefix>.json (Chrome trace, both timelines) and <prefix>.png (Gantt charts side by
    side); returns the paths written."""
    timelines = {"measured": measured, "simulated": simulated}
    paths = [f"{prefix}.json"]
    to_chrome_trace(timelines, paths[0])
    if png:
        paths.append(f"{prefix}.png")
        plot_gantt(timelines, paths[1])
    return paths


def timed(fn: Callable[[], object], group=None) -> tuple[float, float]:
    """Run fn() on every rank, started together after a barrier: (wall seconds on the slowest
    rank, CPU seconds of all ranks together, their helper threads included)."""
    dist.barrier(group=group)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    both = torch.tensor([wall, cpu], dtype=torch.float64)
    slowest = both.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(both, group=group)
    return float(slowest[0]), float(both[1])
