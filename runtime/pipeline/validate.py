"""Schedule validation: placement, completeness, p2p pairing, dependencies,
per-pair message order and deadlock freedom under the execution model
described in :mod:`runtime.pipeline.schedule`."""

from __future__ import annotations

from collections import Counter, defaultdict

from runtime.pipeline.schedule import Action, Kind, Schedule, ScheduleError


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (naming rank and action) if the schedule is wrong."""
    _check_placement(schedule)
    _check_compute(schedule)
    _check_pairs(schedule)
    _check_dependencies(schedule)
    _check_channel_order(schedule)
    execution_order(schedule)  # raises on deadlock


def _check_placement(sched: Schedule) -> None:
    for rank, acts in enumerate(sched.actions):
        for action in acts:
            where = f"rank {rank}: {action}"
            if action.stage >= sched.num_stages:
                raise ScheduleError(f"{where} names stage {action.stage} of {sched.num_stages}")
            if action.mb >= sched.num_microbatches:
                raise ScheduleError(f"{where} names micro-batch {action.mb} of {sched.num_microbatches}")
            owner = sched.stage_to_rank(action.stage)
            if owner != rank:
                raise ScheduleError(f"{where} belongs to stage {action.stage}, which lives on rank {owner}")
            if not action.is_compute and sched.counterpart(action) is None:
                raise ScheduleError(
                    f"{where} has no peer rank: the neighbouring stage is missing or on the same rank"
                )
        for action, count in Counter(acts).items():
            if count > 1:
                raise ScheduleError(f"rank {rank}: {action} appears {count} times")


def _check_compute(sched: Schedule) -> None:
    """Every stage runs F and either B, or I and W, once per micro-batch."""
    for rank, acts in enumerate(sched.actions):
        kinds: dict[tuple[int, int], set[Kind]] = defaultdict(set)
        for action in acts:
            if action.is_compute:
                kinds[action.stage, action.mb].add(action.kind)
        for stage in sched.stages_of(rank):
            for k in range(sched.num_microbatches):
                missing = _missing_compute(kinds.get((stage, k), set()))
                if missing:
                    raise ScheduleError(f"rank {rank}: stage {stage} micro-batch {k} {missing}")


def _missing_compute(kinds: set[Kind]) -> str:
    if Kind.F not in kinds:
        return f"has no forward {Kind.F}"
    if Kind.B in kinds and kinds & {Kind.I, Kind.W}:
        return "mixes a full backward B with a split one (I/W)"
    if Kind.B not in kinds and not kinds & {Kind.I, Kind.W}:
        return "has no backward (B, or I and W)"
    if Kind.B not in kinds and kinds != {Kind.F, Kind.I, Kind.W}:
        return f"has a split backward without {({Kind.I, Kind.W} - kinds).pop()}"
    return ""


def _check_pairs(sched: Schedule) -> None:
    """Every send has its receive on the peer rank and vice versa."""
    have = [set(acts) for acts in sched.actions]
    for rank, acts in enumerate(sched.actions):
        for action in acts:
            if action.is_compute:
                continue
            match, peer = sched.counterpart(action), sched.peer(action)
            if match not in have[peer]:
                raise ScheduleError(f"rank {rank}: {action} has no matching {match} on rank {peer}")


def _prerequisites(sched: Schedule, action: Action) -> list[tuple[Action, ...]]:
    """Same-rank actions that must come earlier; each entry lists alternatives."""
    s, k, kind, last = action.stage, action.mb, action.kind, sched.num_stages - 1
    needs: list[tuple[Action, ...]] = []
    if kind is Kind.F:
        if (recv := sched.recv_for(action)) is not None:
            needs.append((recv,))
        elif s > 0:
            needs.append((Action(s - 1, Kind.F, k),))
    elif kind in (Kind.B, Kind.I):
        needs.append((Action(s, Kind.F, k),))
        if (recv := sched.recv_for(action)) is not None:
            needs.append((recv,))
        elif s < last:
            needs.append((Action(s + 1, Kind.B, k), Action(s + 1, Kind.I, k)))
    elif kind is Kind.W:
        needs.append((Action(s, Kind.I, k),))
    elif kind is Kind.SEND_F:
        needs.append((Action(s, Kind.F, k),))
    elif kind is Kind.SEND_B:
        needs.append((Action(s, Kind.B, k), Action(s, Kind.I, k)))
    return needs


def _check_dependencies(sched: Schedule) -> None:
    for rank, acts in enumerate(sched.actions):
        everything, done = set(acts), set()
        for action in acts:
            for options in _prerequisites(sched, action):
                if done.isdisjoint(options):
                    wanted = " or ".join(str(a) for a in options)
                    if everything.isdisjoint(options):
                        raise ScheduleError(f"rank {rank}: {action} needs {wanted}, which this rank never runs")
                    raise ScheduleError(f"rank {rank}: {action} runs before {wanted}, which it depends on")
            done.add(action)


def _check_channel_order(sched: Schedule) -> None:
    """Untagged p2p matches a rank pair's messages in posting order, so the
    receiver must post its receives in the order the sender posts sends."""
    sent: dict[tuple[int, int], list[Action]] = {}
    for rank, acts in enumerate(sched.actions):
        for action in acts:
            if action.kind.is_send:
                sent.setdefault((rank, sched.peer(action)), []).append(sched.counterpart(action))
    for (src, dst), expected in sent.items():
        posted = [
            a for a in sched.actions[dst] if a.kind in (Kind.RECV_F, Kind.RECV_B) and sched.peer(a) == src
        ]
        for want, got in zip(expected, posted):
            if want != got:
                raise ScheduleError(
                    f"rank {dst}: {got} is posted where rank {src}'s next message to rank {dst} "
                    f"is for {want}; receives from a rank must follow its send order"
                )


def execution_order(sched: Schedule) -> list[tuple[int, Action]]:
    """Replay all ranks under the execution model and return (rank, action)
    pairs in an order where every action follows everything it waits on.
    Assumes the static checks passed; raises ScheduleError on deadlock."""
    pc = [0] * sched.num_ranks
    posted: set[Action] = set()
    order: list[tuple[int, Action]] = []
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(sched.actions):
            while pc[rank] < len(acts):
                action = acts[pc[rank]]
                send = _awaited_send(sched, action)
                if send is not None and send not in posted:
                    break
                if action.kind.is_send:
                    posted.add(action)
                order.append((rank, action))
                pc[rank] += 1
                progress = True
    blocked = [
        _describe_wait(sched, r, acts[pc[r]]) for r, acts in enumerate(sched.actions) if pc[r] < len(acts)
    ]
    if blocked:
        raise ScheduleError("deadlock, no rank can progress: " + "; ".join(blocked))
    return order


def _awaited_send(sched: Schedule, action: Action) -> Action | None:
    recv = sched.recv_for(action) if action.is_compute else None
    return None if recv is None else sched.counterpart(recv)


def _describe_wait(sched: Schedule, rank: int, action: Action) -> str:
    send = _awaited_send(sched, action)
    return f"rank {rank} waits at {action} for {send} from rank {sched.stage_to_rank(send.stage)}"
