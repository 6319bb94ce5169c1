"""Where one rank's training step goes: its wall time split into parts that add up to it.

    with StepClock(trainer) as clock:
        trainer.step(*batch)
        dist.barrier()           # what the rank then waits for the others counts as idle
    clock.parts()                # {"F0": s, "B0": s, ..., "p2p wait": s, "optimizer": s, ...}

The parts:
  F<s>, B<s>, I<s>, W<s>  compute actions of stage s, as the executor times them (its events)
  p2p wait                 waiting for a pipeline neighbour's activations or gradients, and for
                           the last sends to complete
  dp sync                  waiting for the data-parallel gradient collectives and the gradient
                           norm's all-reduce, and the all-gather after a sharded step
  step sync                the step's opening check that every rank was given the same batch
  optimizer                the optimizer step
  overhead                 everything else inside the step: Python between actions, posting
                           messages, splitting the batch, zeroing gradients
  idle                     waiting for the other ranks at the end (the loss broadcast, a barrier)

The phases come from runtime.launch.activity, which the trainer already tells what it is doing at each
of them; listening costs one clock read per phase change.
"""
from __future__ import annotations

import time
from collections import defaultdict

from runtime.launch import activity

PARTS = ("p2p wait", "dp sync", "step sync", "optimizer", "overhead", "idle")

# runtime.training.trainer's activity texts, by the part they belong to; "action ..." is the schedule.
_PHASES = (("waiting for the data-parallel", "dp sync"), ("waiting for the sharded", "dp sync"),
           ("data-parallel all-reduce of stage", "dp sync"),
           ("sharded data-parallel all-gather", "dp sync"), ("gradient-norm", "dp sync"),
           ("optimizer step", "optimizer"), ("loss broadcast", "idle"),
           ("comparing the ranks' batches", "step sync"),
           ("action ", "schedule"), ("the end of the schedule", "schedule"))


def phase_of(doing: str) -> str:
    return next((part for prefix, part in _PHASES if doing.startswith(prefix)), "overhead")


class StepClock:
    """Times the phases of the steps run inside it on this rank (see the module docstring)."""

    def __init__(self, trainer):
        self.executor = trainer.executor
        self._marks: list[tuple[float, str]] = []

    def __enter__(self) -> StepClock:
        self._marks = [(time.perf_counter(), "start")]
        activity.listen(self._mark)
        return self

    def __exit__(self, *exc) -> None:
        activity.unlisten(self._mark)
        self._mark("idle")  # a barrier after the step, if any, up to here
        self._end = time.perf_counter()
        self._parts = self._split()  # now: the executor's records are this step's

    def _mark(self, doing: str) -> None:
        self._marks.append((time.perf_counter(), doing))

    @property
    def seconds(self) -> float:
        """The time inside the `with`."""
        return self._end - self._marks[0][0]

    def intervals(self, prefix: str, containing: str = "") -> list[float]:
        """Seconds of each phase whose activity text starts with `prefix` and contains
        `containing` ("action ", "SEND": the time posting each send)."""
        ends = [t for t, _ in self._marks[1:]] + [self._end]
        return [end - start for (start, doing), end in zip(self._marks, ends)
                if doing.startswith(prefix) and containing in doing]

    def parts(self) -> dict[str, float]:
        """Seconds per part; they add up to the time inside the `with`."""
        return dict(self._parts)

    def _split(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        ends = [t for t, _ in self._marks[1:]] + [self._end]
        for (start, doing), end in zip(self._marks, ends):
            totals["idle" if doing == "idle" else phase_of(doing)] += end - start
        schedule = totals.pop("schedule", 0.0)
        for e in self.executor.events:
            totals[f"{e.action.kind.value}{e.action.stage}"] += e.end - e.start
            schedule -= e.end - e.start
        for _, start, end in self.executor.waits:
            totals["p2p wait"] += end - start
            schedule -= end - start
        totals["overhead"] += schedule  # the schedule's time outside compute and waits
        return dict(totals)


def rank_record(trainer, clocks: list[StepClock]) -> dict:
    """What this rank tells the benchmark: its pipeline index, the mean step and the mean of
    each part over the measured steps, and the last step's compute actions and p2p waits."""
    parts = [c.parts() for c in clocks]
    names = sorted({name for p in parts for name in p})
    executor = trainer.executor
    return {"rank": trainer.groups.rank, "pp_rank": executor.pp_rank,
            "step_s": sum(c.seconds for c in clocks) / max(len(clocks), 1),
            "parts": {n: sum(p.get(n, 0.0) for p in parts) / max(len(parts), 1) for n in names},
            "events": [[str(e.action), e.start, e.end] for e in executor.events],
            "waits": [list(w) for w in executor.waits]}
