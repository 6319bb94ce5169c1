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


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (3, 1)])
def test_recorded_gradients_counted_from_each_i_to_its_w(p, m):
    """ZB-H1 under split_backward "record": the gradients I records live until W, on every
    stage but the first; the moments count them beside the activation sets, brute-forced here
    from the schedule's actions."""
    from runtime.pipeline.generators import inflight_moments
    from runtime.pipeline.schedule import Kind
    moments = inflight_moments("zb-h1", p, m, 1, records=True)
    for r, actions in enumerate(make_schedule("zb-h1", p, m, 1).actions):
        acts = recorded = 0
        peaks = []
        for a in actions:
            acts += (a.kind == Kind.F) - (a.kind == Kind.W)
            recorded += (r > 0) * ((a.kind == Kind.I) - (a.kind == Kind.W))
            peaks.append((acts, recorded))
        # every state reached is covered by a kept moment, and every kept moment is reached
        assert all(any(x >= a and y >= b for x, y in moments[r]) for a, b in peaks)
        assert set(moments[r]) <= set(peaks)
        assert max(y for _, y in moments[r]) == (min(r + 1, m) if r else 0)
