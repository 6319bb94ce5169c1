"""When a rank may let go of what it sent: the first message from the peer that proves arrival.

A pipeline rank posts its sends without waiting (isend) and must keep each sent tensor until the
transfer is done. gloo's send work reports completion only to wait() (`is_completed()` stays
False until then, however long ago the peer received), and waiting on a send whose receive the
peer has not yet posted blocks. So the executor waits on a send at the first moment the schedule
proves the transfer done: when this rank takes a message that the peer sent after it consumed
the send. Received then, the send has completed and the wait returns at once; with no such
message the send is waited on when the step ends.

The rule depends only on the order of the schedule's actions, so a rank's sent tensors are freed
at the same points on every backend and on every run, and a dry run on fake tensors
(planner.bench.dry_run), whose sends complete at once, frees them where a real rank does.
"""
from __future__ import annotations

from collections import defaultdict

from runtime.pipeline.schedule import Action, Schedule


def releases(schedule: Schedule, rank: int) -> dict[Action, tuple[Action, ...]]:
    """For each receive of `rank`: the sends of `rank` known complete once it has arrived."""
    released: dict[Action, list[Action]] = defaultdict(list)
    proofs: dict[int, dict[Action, Action | None]] = {}
    for send in schedule.actions[rank]:
        if not send.kind.is_send:
            continue
        recv = schedule.counterpart(send)
        peer = schedule.stage_to_rank(recv.stage)
        if peer not in proofs:
            proofs[peer] = _proofs(schedule, peer, rank)
        proof = proofs[peer][recv]
        if proof is not None:
            released[schedule.counterpart(proof)].append(send)
    return {recv: tuple(sends) for recv, sends in released.items()}


def _proofs(schedule: Schedule, peer: int, to: int) -> dict[Action, Action | None]:
    """For each receive of `peer`, the first send from `peer` to rank `to` after the compute
    action that consumes it (None if there is none): one backward pass over its actions."""
    proofs, following = {}, None
    for action in reversed(schedule.actions[peer]):
        if action.kind.is_send and schedule.peer(action) == to:
            following = action
        elif action.is_compute and (recv := schedule.recv_for(action)) is not None:
            proofs[recv] = following
    return proofs
