"""Closed-form peak in-flight counts agree with simulating the generated schedules."""
import pytest

from runtime.pipeline.generators import make_schedule, peak_inflight
from runtime.pipeline.simulator import simulate


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                    ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 6), (4, 4), (4, 8), (4, 12)])
def test_peak_inflight_matches_simulation(name, v, p, m):
    if name == "interleaved-1f1b" and m % p:
        pytest.skip("interleaved needs m % p == 0")
    schedule = make_schedule(name, p, m, v)
    timeline = simulate(schedule, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})
    assert timeline.peak_inflight == peak_inflight(name, p, m, v)
