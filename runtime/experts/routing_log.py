"""The rows a rank's mixture-of-experts layers route, recorded on a real run to be replayed in a
dry run.

A real step routes by values (runtime.experts.dispatch); a dry run (planner.bench.dry_run) has
none, so by default it spreads each layer's slots evenly over the experts, as the planner prices
a balanced router (`even`). Routing decides how many rows each rank's experts hold, and so what
the rank keeps for backward: to set a dry run beside a measured run on the same routing, the
measured rank records, call by call, the rows it sent to each expert and the rows each of its
local experts got from each rank of its expert-parallel group (`recording`), and the dry run of
that rank replays them in the same order (`replaying`).

A routing is (sent, got): sent[e] the rows this rank sends to expert e (E of them), got[r][j]
the rows its local expert j receives from rank r of its expert-parallel group ([ep][E/ep]).
"""
from __future__ import annotations

from contextlib import contextmanager

Routing = tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]

_LOG: list = [None]       # the list a real run records to, or None
_REPLAY: list = [None]    # [iterator, calls replayed so far] while a dry run replays, or None


@contextmanager
def recording():
    """Record every routing made inside; yields the list they are appended to."""
    log: list[Routing] = []
    _LOG[0] = log
    try:
        yield log
    finally:
        _LOG[0] = None


@contextmanager
def replaying(log):
    """Route the calls made inside as `log` (a recording) routed them, in order; an empty or
    None log leaves routing even. Every recorded call must be replayed, no more."""
    if not log:
        yield
        return
    _REPLAY[0] = [iter(log), 0]
    ok = False
    try:
        yield
        ok = True
    finally:
        it, done = _REPLAY[0]
        _REPLAY[0] = None
    if ok and next(it, None) is not None:
        raise RuntimeError(f"the dry run routed {done} mixture-of-experts calls where the "
                           f"recorded run routed {len(log)}: replay the same plan and steps")


def record(sent: list[int], got: list[list[int]]) -> None:
    if _LOG[0] is not None:
        _LOG[0].append((tuple(sent), tuple(tuple(row) for row in got)))


def dry_routing(slots: int, experts: int, ep: int, me: int) -> Routing:
    """A dry run's routing of `slots` rows: the next recorded one when replaying, else `even`."""
    if _REPLAY[0] is None:
        return even(slots, experts, ep, me)
    it, done = _REPLAY[0]
    routing = next(it, None)
    if routing is None:
        raise RuntimeError(f"the dry run routes more mixture-of-experts calls than the "
                           f"recorded run's {done}: replay the same plan and steps")
    if sum(routing[0]) != slots or len(routing[0]) != experts or len(routing[1]) != ep:
        raise RuntimeError(f"mixture-of-experts call {done + 1} routes {slots} rows over "
                           f"{experts} experts and {ep} ranks, but the recorded run routed "
                           f"{sum(routing[0])} over {len(routing[0])} and {len(routing[1])}: "
                           "replay the same plan and batch")
    _REPLAY[0][1] = done + 1
    return routing


def even(slots: int, experts: int, ep: int, me: int) -> Routing:
    """Every rank sends each expert its share of `slots` (the first slots % E one more)."""
    sent = tuple(slots // experts + (e < slots % experts) for e in range(experts))
    local = experts // ep
    return sent, tuple(sent[me * local:(me + 1) * local] for _ in range(ep))
