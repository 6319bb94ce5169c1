"""Calibration's received-message probe (planner.bench_runtime._recv_worker) on two real gloo
ranks: posting and taking a message and gloo's thread moving it cost each rank some CPU, less
than the probe's rounds of computing between messages."""
import pytest

from conftest import rank_pool
from planner.bench_runtime import RECV_GAP_S, _recv_worker


@pytest.mark.dist
def test_a_received_message_costs_cpu_and_less_than_a_round():
    per_message = rank_pool(2).run(_recv_worker, 40)
    assert len(per_message) == 2
    for seconds in per_message:
        assert 0 < seconds < 2 * RECV_GAP_S, per_message
