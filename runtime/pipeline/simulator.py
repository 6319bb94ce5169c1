"""Discrete-event simulation of a pipeline schedule.

Every rank runs its actions in order. Compute actions take their duration;
SEND/RECV posts take no time on the posting rank, and the data of a send
arrives ``p2p_time`` after it is posted. A compute action that waits on a
receive starts once the rank is free and the data has arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.pipeline.schedule import Action, Kind, Schedule
from runtime.pipeline.validate import execution_order, validate


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What ran where and when. ``peak_*`` are per rank and may be empty for
    timelines built from measurements. ``peak_inflight`` counts (stage,
    micro-batch) pairs with live activations: micro-batches when a rank holds
    one stage, chunks of 1/v of a micro-batch's layers with interleaving."""

    events: tuple[Event, ...]
    makespan: float
    peak_inflight: tuple[int, ...] = ()
    peak_activation_bytes: tuple[float, ...] = ()

    @staticmethod
    def from_events(events: tuple[Event, ...] | list[Event]) -> Timeline:
        """A timeline from measured events; makespan is first start to last end."""
        events = tuple(events)
        if not events:
            return Timeline((), 0.0)
        return Timeline(events, max(e.end for e in events) - min(e.start for e in events))

    @property
    def num_ranks(self) -> int:
        return max((e.rank for e in self.events), default=-1) + 1

    def busy(self, rank: int) -> float:
        """Seconds of compute on ``rank``."""
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.action.is_compute)

    def bubble_fraction(self) -> float:
        """Pipeline bubble as defined in the literature (GPipe, Megatron,
        zero-bubble papers): ``(makespan - ideal) / ideal`` where ``ideal`` is
        the compute time of the busiest rank, i.e. the time without any bubble.

        Idle time relative to useful work, not to the makespan: it is
        (p - 1) / m for GPipe and 1F1B with t_B = 2 t_F, (p - 1) / (v m) for
        interleaved 1F1B and about (p - 1) / (3 m) for ZB-H1 with equal F, I, W.
        """
        ideal = max((self.busy(r) for r in range(self.num_ranks)), default=0.0)
        if ideal <= 0:
            raise ValueError("bubble fraction of a timeline without compute")
        return (self.makespan - ideal) / ideal


Durations = Mapping[str, float] | Callable[[Action], float]


def simulate(
    schedule: Schedule,
    durations: Durations,
    p2p_time: float = 0.0,
    activation_bytes: Mapping[int, float] | None = None,
) -> Timeline:
    """Simulate ``schedule``; ``durations`` maps "F", "B", "I", "W" to seconds
    (same for every stage) or is a function of the action. Events cover compute
    actions only. ``activation_bytes`` maps stage -> bytes kept alive per
    micro-batch (peak bytes are 0 without it)."""
    validate(schedule)
    if p2p_time < 0:
        raise ValueError(f"p2p_time must be >= 0, got {p2p_time}")
    duration = _duration_fn(durations)
    clock = [0.0] * schedule.num_ranks
    sent_at: dict[Action, float] = {}
    events = []
    for rank, action in execution_order(schedule):
        if action.kind.is_send:
            sent_at[action] = clock[rank]
        if not action.is_compute:
            continue
        start = clock[rank]
        if (recv := schedule.recv_for(action)) is not None:
            start = max(start, sent_at[schedule.counterpart(recv)] + p2p_time)
        clock[rank] = start + duration(action)
        events.append(Event(rank, action, start, clock[rank]))
    events.sort(key=lambda e: (e.rank, e.start))
    inflight, peak_bytes = _peak_memory(schedule, activation_bytes or {})
    return Timeline(tuple(events), max(clock), inflight, peak_bytes)


def _duration_fn(durations: Durations) -> Callable[[Action], float]:
    if callable(durations):
        fn = durations
    else:
        table = dict(durations)

        def fn(action: Action) -> float:
            if action.kind.value not in table:
                raise ValueError(f"durations has no entry for {action.kind.value!r} (needed by {action})")
            return table[action.kind.value]

    def checked(action: Action) -> float:
        seconds = float(fn(action))
        if seconds < 0:
            raise ValueError(f"negative duration {seconds} for {action}")
        return seconds

    return checked


def _peak_memory(
    schedule: Schedule, activation_bytes: Mapping[int, float]
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Activations of (stage, mb) live from F until B, or until W when the
    backward is split (W still needs the stage inputs)."""
    peaks, peak_bytes = [], []
    for acts in schedule.actions:
        alive: set[tuple[int, int]] = set()
        peak, top, now = 0, 0.0, 0.0
        for action in acts:
            key, size = (action.stage, action.mb), activation_bytes.get(action.stage, 0.0)
            if action.kind is Kind.F:
                alive.add(key)
                now += size
            elif action.kind in (Kind.B, Kind.W) and key in alive:
                alive.remove(key)
                now -= size
            peak, top = max(peak, len(alive)), max(top, now)
        peaks.append(peak)
        peak_bytes.append(top)
    return tuple(peaks), tuple(peak_bytes)


def grid(schedule: Schedule) -> str:
    """The schedule's text grid: compute actions laid out by a unit-time simulation (every
    compute action takes one slot, communication is free); '.' marks idle slots."""
    timeline = simulate(schedule, {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0})
    cells = [["."] * round(timeline.makespan) for _ in range(schedule.num_ranks)]
    for event in timeline.events:
        cells[event.rank][round(event.start)] = str(event.action)
    width = max((len(c) for row in cells for c in row), default=1)
    label = len(f"rank {schedule.num_ranks - 1}:")
    return "\n".join(
        f"rank {r}:".ljust(label) + " " + " ".join(c.ljust(width) for c in row).rstrip()
        for r, row in enumerate(cells)
    )
