"""A rank that dies, raises or is interrupted ends the whole run fast, and the first line of the
error names the rank, where it was and what happened."""
import os
import re
import signal
import sys
import tempfile
import time

import pytest

from tests.harness.faults import interrupt_cli, timed_fault
from runtime.launch import activity
from runtime.launch.ranks import GRACE_S, RankFailure, RankPool, _failure, _Report

TIMEOUT_S = 12  # the process-group timeout of these runs: every end must come well before it


def _fail(tmp_path, dp, pp, victim, point, fate="kill"):
    return timed_fault(str(tmp_path), dp, pp, victim, point, fate, timeout_s=TIMEOUT_S)


# (dp, pp, victim, point, what the first line says about where). Ranks are laid out pp
# outermost: with pp=2, rank 0 holds stage 0 (it sends activations), the last rank stage 1.
KILLS = [
    (1, 2, 0, "forward p2p", r"in step 2, action 0SEND_F0 \(to rank 1\)"),
    (1, 2, 1, "backward", r"in step 2, action 1B0"),
    (2, 2, 2, "dp all-reduce", r"in step 2, data-parallel all-reduce of stage 1"),
    (2, 1, 1, "optimizer step", r"in step 2, optimizer step"),
]


@pytest.mark.dist
@pytest.mark.parametrize("dp,pp,victim,point,where", KILLS, ids=[k[3] for k in KILLS])
def test_killed_rank_ends_the_run_fast_and_is_named_first(tmp_path, dp, pp, victim, point,
                                                          where):
    failure, took = _fail(tmp_path, dp, pp, victim, point)
    summary = str(failure).splitlines()[0]
    assert re.fullmatch(rf"rank {victim} died: killed by SIGKILL, {where}", summary), summary
    assert failure.rank == victim and failure.summary == summary
    print(f"{point}: kill -> last exit {took:.2f} s")
    assert took < min(GRACE_S + 3, TIMEOUT_S / 2)


@pytest.mark.dist
def test_raising_rank_is_named_first_with_its_error(tmp_path):
    failure, took = _fail(tmp_path, 1, 2, 1, "backward", fate="raise")
    lines = str(failure).splitlines()
    assert lines[0] == ("rank 1 failed in step 2, action 1B0: InjectedFault: injected fault at "
                        "the backward of step 2")
    assert lines[1] == "the other ranks:" and lines[2].startswith("  rank 0 ")
    assert "Traceback" in str(failure) and "--- rank 1 ---" in str(failure)
    assert took < min(GRACE_S + 3, TIMEOUT_S / 2)


def test_the_cause_comes_before_collateral_errors():
    """Whatever order the reports arrive in: a signal death, then the first error of a rank's
    own, then ranks that exited early; transport errors and timeouts only after them."""
    peer = _Report("error", "step 1, action 1F0", "PeerError: rank 1 waiting for 1RECV_F0 from "
                   "rank 0 failed: Connection closed by peer", "tb1", when=1.0)
    timeout = _Report("error", "step 1, loss broadcast", "RuntimeError: [third_party/gloo/gloo/"
                      "transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms", when=2.0)
    own = _Report("error", "step 1, action 0F0", "ValueError: bad input", "tb0", when=3.0)
    later = _Report("error", "step 1, action 3F0", "KeyError: 'x'", when=4.0)
    killed = _Report("killed", "step 1, optimizer step", "killed by SIGKILL", when=5.0)
    ended = _Report("killed", "step 1, action 2B0", "killed by SIGTERM", when=6.0,
                    by_launcher=True)
    assert _failure({0: own, 1: peer, 2: timeout, 3: later}).rank == 0
    assert _failure({0: own, 1: peer, 2: killed, 3: ended}).rank == 2
    assert _failure({0: ended, 1: peer, 2: timeout}).rank == 1
    text = str(_failure({0: own, 1: peer}))
    assert text.splitlines()[0] == "rank 0 failed in step 1, action 0F0: ValueError: bad input"
    assert text.index("--- rank 0 ---") < text.index("--- rank 1 ---")


def test_fxpar_prints_the_first_line_and_writes_the_rest_to_a_file(tmp_path, capsys):
    from planner.cli import _guarded
    failure = _failure({0: _Report("error", "step 1, action 0F0", "ValueError: bad input", "tb0"),
                        1: _Report("stopped", "step 1, action 1F0", by_launcher=True)})

    def run(failure):
        raise failure

    tempfile.tempdir, saved = str(tmp_path), tempfile.tempdir
    try:
        assert _guarded(run, failure) == 2
    finally:
        tempfile.tempdir = saved
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxpar: error: rank 0 failed in step 1, action 0F0: ValueError: bad "
                          "input (all ranks and tracebacks: ")
    with open(err.rsplit(": ", 1)[1].rstrip(")")) as f:
        assert f.read() == str(failure) + "\n"
    assert _guarded(run, KeyboardInterrupt()) == 130


def _die_in_rank_one(collective: str) -> int:
    import torch.distributed as dist
    activity.now(collective)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the survivor is ended by the pool
    return 0


@pytest.mark.dist
def test_pool_names_a_dead_rank_and_closes():
    pool = RankPool(2, timeout_s=TIMEOUT_S)
    try:
        assert pool.run(os.getpid) != [os.getpid()] * 2  # the ranks are up
        start = time.monotonic()
        with pytest.raises(RankFailure) as err:
            pool.run(_die_in_rank_one, "a made-up all-gather")
        assert time.monotonic() - start < GRACE_S + 3
        summary = str(err.value).splitlines()[0]
        assert summary == "rank 1 died: killed by SIGKILL, in a made-up all-gather"
        assert "rank 0 was still running in a made-up all-gather" in str(err.value)
        assert not pool.alive
        with pytest.raises(RuntimeError, match="closed after a failure: rank 1 died"):
            pool.run(_die_in_rank_one, "again")
    finally:
        pool.close()


@pytest.mark.dist
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_ends_every_rank_and_fxpar_run_exits_130(tmp_path):
    code, ranks_ended, exited, ranks, left = interrupt_cli(str(tmp_path))
    assert code == 130 and len(ranks) == 2
    assert not left, f"ranks {left} outlived the launcher"
    print(f"SIGINT -> ranks ended {ranks_ended:.2f} s, launcher exited {exited:.2f} s")
    assert ranks_ended < 3
    assert exited < 15  # mostly the interpreter's own teardown, seconds on a loaded machine
