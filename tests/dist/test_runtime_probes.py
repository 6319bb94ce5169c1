"""Calibration's probes of the runtime (planner.bench.runtime_probes) on two real gloo ranks."""
import pytest

from conftest import rank_pool
from planner.bench.runtime_probes import RECV_GAP_S, _recv_worker, _step_sync_worker


@pytest.mark.dist
def test_a_received_message_costs_cpu_and_less_than_a_round():
    """Posting and taking a message and gloo's thread moving it cost each rank some CPU, less
    than the probe's rounds of computing between messages."""
    per_message = rank_pool(2).run(_recv_worker, 40)
    assert len(per_message) == 2
    for seconds in per_message:
        assert 0 < seconds < 2 * RECV_GAP_S, per_message


@pytest.mark.dist
def test_the_steps_own_all_reduces_take_time_but_less_than_the_computing_between():
    """The step's two opening all-reduces and its closing one, as a step reaches them: each
    side takes some time on every rank, and far less than the 20 ms computed between."""
    sides = rank_pool(2).run(_step_sync_worker, 5, 0.02)
    assert len(sides) == 2
    for start, finish in sides:
        assert 0 < start < 0.02 and 0 < finish < 0.02, sides
