"""When a pipeline rank may wait on a send without blocking: runtime.pipeline.send_release
against a brute-force reading of the schedule."""
import pytest

from runtime.pipeline.generators import make_schedule
from runtime.pipeline.send_release import releases

SCHEDULES = [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("zb-h1", 3, 6, 1),
             ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2)]


def test_one_f_one_b_on_two_ranks_by_hand():
    sched = make_schedule("1f1b", 2, 4)
    named = {r: {str(k): [str(s) for s in v] for k, v in releases(sched, r).items()}
             for r in range(2)}
    # Stage 0's forward of mb k has arrived once the gradient of mb k comes back; stage 1's
    # gradient of mb k once stage 0's next forward after B k (mb k + 2) arrives.
    assert named[0] == {f"0RECV_B{k}": [f"0SEND_F{k}"] for k in range(4)}
    assert named[1] == {"1RECV_F2": ["1SEND_B0"], "1RECV_F3": ["1SEND_B1"]}


def _brute_force(sched, rank):
    """For each send of `rank`: the first message the peer sends to `rank` after the peer's
    compute action that waited on it, found by scanning the peer's actions."""
    expected = {}
    for send in (a for a in sched.actions[rank] if a.kind.is_send):
        recv = sched.counterpart(send)
        peer_actions = sched.actions[sched.stage_to_rank(recv.stage)]
        consumed = [i for i, a in enumerate(peer_actions)
                    if a.is_compute and sched.recv_for(a) == recv]
        assert len(consumed) == 1
        later = [a for a in peer_actions[consumed[0] + 1:]
                 if a.kind.is_send and sched.peer(a) == rank]
        if later:
            expected.setdefault(sched.counterpart(later[0]), []).append(send)
    return {recv: tuple(sends) for recv, sends in expected.items()}


@pytest.mark.parametrize("name,p,m,v", SCHEDULES)
def test_every_release_is_the_first_proof_the_schedule_gives(name, p, m, v):
    sched = make_schedule(name, p, m, v)
    for rank in range(p):
        got = releases(sched, rank)
        assert got == _brute_force(sched, rank)
        for recv, sends in got.items():
            assert recv in sched.actions[rank]       # a receive of this very rank
            for send in sends:                       # ... posted after the send it releases
                assert sched.actions[rank].index(send) < sched.actions[rank].index(recv)


def test_without_a_later_message_a_send_is_left_to_the_end_of_the_step():
    sched = make_schedule("1f1b", 2, 4)
    released = {s for sends in releases(sched, 1).values() for s in sends}
    last = [a for a in sched.actions[1] if a.kind.is_send][-2:]   # gradients of mbs 2 and 3
    assert not released & set(last)
