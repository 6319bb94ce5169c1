"""Pipeline schedule generators: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

Each generator first decides the order of compute actions on every rank and
then lets :func:`_with_comms` add the point-to-point actions:

* a send is posted right after the compute that produces its data;
* a receive is posted right before the compute that consumes it.

Posting receives "just in time" keeps each send next to the receive that the
neighbouring compute needs (send-forward/recv-backward pairs, as in
Megatron), which an executor can issue as one batched p2p group. Receives
are posted earlier only when needed to keep every rank pair's messages in the
same order on both ends, because untagged p2p (NCCL) matches sends and
receives between two ranks in posting order.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

from runtime.pipeline.schedule import Action, Kind, Schedule


def _check_args(p: object, m: object, v: object = 1) -> None:
    for label, value in (("p (ranks)", p), ("m (micro-batches)", m), ("v (stages per rank)", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}")


def gpipe(p: int, m: int, comms: bool = True) -> Schedule:
    """All forwards, then all backwards: every micro-batch is in flight at once."""
    _check_args(p, m)
    orders = [
        [Action(r, Kind.F, k) for k in range(m)] + [Action(r, Kind.B, k) for k in range(m)]
        for r in range(p)
    ]
    return _with_comms(Schedule("gpipe", p, p, m, orders), comms)


def one_f_one_b(p: int, m: int, comms: bool = True) -> Schedule:
    """1F1B: rank r runs min(p - r - 1, m) warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards, so at
    most min(p - r, m) micro-batches are in flight on rank r."""
    _check_args(p, m)
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action(r, Kind.F, k) for k in range(warmup)]
        for k in range(m - warmup):
            order += [Action(r, Kind.F, warmup + k), Action(r, Kind.B, k)]
        order += [Action(r, Kind.B, k) for k in range(m - warmup, m)]
        orders.append(order)
    return _with_comms(Schedule("1f1b", p, p, m, orders), comms)


def interleaved_1f1b(p: int, m: int, v: int = 2, comms: bool = True) -> Schedule:
    """Megatron's interleaved 1F1B with v stages per rank (stage c*p + r on
    rank r). Micro-batches go through the local stages in groups of p, which
    is why m must be a multiple of p."""
    _check_args(p, m, v)
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batch count to be a multiple of "
            f"the rank count: m={m}, p={p}"
        )
    total = m * v  # forward steps per rank, one per (local stage, micro-batch)
    orders = []
    for r in range(p):
        # Megatron's warm-up: enough forwards that the first backward has
        # arrived by the time the warm-up is over.
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [_interleaved_step(p, v, r, k, forward=True) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(_interleaved_step(p, v, r, warmup + k, forward=True))
            order.append(_interleaved_step(p, v, r, k, forward=False))
        order += [_interleaved_step(p, v, r, k, forward=False) for k in range(total - warmup, total)]
        orders.append(order)
    return _with_comms(Schedule("interleaved-1f1b", p, p * v, m, orders), comms)


def _interleaved_step(p: int, v: int, rank: int, step: int, forward: bool) -> Action:
    group, pos = divmod(step, p * v)
    chunk = pos // p if forward else v - 1 - pos // p
    return Action(chunk * p + rank, Kind.F if forward else Kind.B, group * p + pos % p)


def zb_h1(p: int, m: int, comms: bool = True) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2023): 1F1B with the backward split into
    I (input gradient, on the critical path) and W (weight gradient). Rank r
    runs each W r micro-batches after its I, so the trailing W's fill the
    cool-down bubble; peak in-flight stays at p micro-batches, as in 1F1B."""
    _check_args(p, m)
    orders = []
    for r in range(p):
        warmup, lag = min(p - r - 1, m), r
        order = [Action(r, Kind.F, k) for k in range(warmup)]

        def backward(k: int) -> None:
            order.append(Action(r, Kind.I, k))
            if k >= lag:
                order.append(Action(r, Kind.W, k - lag))

        for k in range(m - warmup):
            order.append(Action(r, Kind.F, warmup + k))
            backward(k)
        for k in range(m - warmup, m):
            backward(k)
        order += [Action(r, Kind.W, k) for k in range(max(m - lag, 0), m)]
        orders.append(order)
    return _with_comms(Schedule("zb-h1", p, p, m, orders), comms)


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def schedule_error(name: str, p: int, m: int, v: int = 1) -> str | None:
    """Why make_schedule(name, p, m, v) would refuse, or None when it builds: without building
    anything (the planner asks this of every configuration it considers)."""
    try:
        _check_args(p, m, v)
    except ValueError as err:
        return str(err)
    if name not in SCHEDULES:
        return f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}"
    if name == "interleaved-1f1b" and m % p:
        return (f"interleaved 1F1B needs the micro-batch count to be a multiple of the rank "
                f"count: m={m}, p={p}")
    if name != "interleaved-1f1b" and v != 1:
        return f"schedule {name!r} has one stage per rank; got v={v}"
    return None


def make_schedule(name: str, p: int, m: int, v: int = 1, comms: bool = True) -> Schedule:
    """Build a schedule by name; v (stages per rank) applies to interleaved only. Without
    `comms`, each rank's compute actions only, in their order (what counting needs)."""
    why = schedule_error(name, p, m, v)
    if why:
        raise ValueError(why)
    if name == "interleaved-1f1b":
        return interleaved_1f1b(p, m, v, comms)
    return SCHEDULES[name](p, m, comms)


def _with_comms(compute_only: Schedule, comms: bool = True) -> Schedule:
    """Add SEND/RECV actions around the compute actions of every rank (`comms`)."""
    if not comms:
        return compute_only
    sched = compute_only
    # Pass 1: sends right after their compute; remember each channel's
    # (src, dst) message order as the receives the destination must post.
    with_sends, channel = [], defaultdict(list)
    for rank, acts in enumerate(sched.actions):
        row = []
        for action in acts:
            row.append(action)
            if (send := sched.send_after(action)) is not None:
                row.append(send)
                channel[rank, sched.peer(send)].append(sched.counterpart(send))
        with_sends.append(row)
    # Pass 2: receives before their compute, in the sender's order.
    position = {recv: i for queue in channel.values() for i, recv in enumerate(queue)}
    posted = defaultdict(int)  # (src, dst) -> receives already posted
    rows = []
    for rank, acts in enumerate(with_sends):
        row = []
        for action in acts:
            recv = sched.recv_for(action) if action.is_compute else None
            if recv is not None:
                key = (sched.peer(recv), rank)
                upto = position[recv] + 1
                if upto > posted[key]:
                    row += channel[key][posted[key] : upto]
                    posted[key] = upto
            row.append(action)
        rows.append(row)
    return Schedule(sched.name, sched.num_ranks, sched.num_stages, sched.num_microbatches, rows)


def peak_inflight(name: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activation sets alive at once under each generator
    (the simulator's count, in closed form so the planner need not simulate)."""
    if name == "gpipe":
        return tuple(m * v for _ in range(p))
    if name == "1f1b":
        return tuple(min(p - r, m) for r in range(p))
    if name == "zb-h1":  # each W trails its I by r micro-batches: p alive on every rank
        return tuple(min(p, m) for _ in range(p))
    if name == "interleaved-1f1b":
        return tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))
    raise ValueError(f"unknown schedule {name!r}; known: {sorted(SCHEDULES)}")


def inflight_moments(name: str, p: int, m: int, v: int = 1, records: bool = False
                     ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the activation sets each of its stages (local index c: stage c·p + r) holds
    at the moments one of them could peak: after each forward, the counts per local stage,
    keeping only moments no other covers (at least as many sets on every stage). A set lives
    from its stage's forward until the backward that frees its graph: B, or W under ZB-H1
    (the runtime's W walks the graph again). With stages of unequal activations (the one with
    the loss head, say) the peak is the largest Σ_c count_c · a_c over these moments, which
    `peak_inflight`'s one count per rank cannot tell. With `records` (ZB-H1 under
    split_backward "record", runtime.pipeline.split_backward) each moment also counts, after
    the v activation counts, the sets of gradients I recorded for a W still to come, per local
    stage (none on stage 0, whose I has no input to reach), and the moments after each I too.

    Past 2p micro-batches a schedule other than GPipe only repeats its steady state: its
    moments are those of the first legal count from 2p (tests/unit/test_schedules.py checks
    it against the whole schedule), so a step of a thousand micro-batches is counted as one of
    2p."""
    if name != "gpipe" and m > 2 * p:
        m = next(k for k in range(2 * p, m + 1) if schedule_error(name, p, k, v) is None)
    return _moments(name, p, m, v, records)


@lru_cache(maxsize=4096)
def _moments(name: str, p: int, m: int, v: int, records: bool):
    schedule = make_schedule(name, p, m, v, comms=False)  # the compute order is what counts
    frees = Kind.W if name == "zb-h1" else Kind.B
    result = []
    for r, actions in enumerate(schedule.actions):
        count, moments = [0] * (2 * v if records else v), set()
        for a in actions:
            c = a.stage // p
            if a.kind == Kind.F:
                count[c] += 1
                moments.add(tuple(count))
            elif a.kind == Kind.I and records and a.stage > 0:
                count[v + c] += 1
                moments.add(tuple(count))
            elif a.kind == frees:
                count[c] -= 1
                if records and a.stage > 0:
                    count[v + c] -= 1
        kept = [mo for mo in moments
                if not any(o != mo and all(x >= y for x, y in zip(o, mo)) for o in moments)]
        result.append(tuple(sorted(kept)))
    return tuple(result)
