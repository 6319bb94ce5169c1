"""Schedule simulation, bubble fractions, memory peaks and timeline export."""

import json

import pytest

from runtime.pipeline.generators import gpipe, interleaved_1f1b, make_schedule, one_f_one_b, zb_h1
from runtime.pipeline.schedule import Action, Kind
from runtime.pipeline.simulator import Event, Timeline, simulate
from runtime.pipeline.timeline import plot_gantt, to_chrome_trace

FB = {"F": 1.0, "B": 2.0}  # t_B = 2 t_F, the usual assumption in the literature
FIW = {"F": 1.0, "I": 1.0, "W": 1.0}


def _close(value: float, expected: float) -> bool:
    return abs(value - expected) <= 0.05 * expected


# Bubble fractions. The closed forms are exact for GPipe/1F1B/interleaved
# and, for ZB-H1, once m >= p (with fewer micro-batches than ranks the
# deferred W's cannot cover the warm-up); m = 4p and 8p are used throughout.


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("factor", [4, 8])
def test_bubble_gpipe_and_1f1b(build, p, factor):
    m = factor * p
    assert _close(simulate(build(p, m), FB).bubble_fraction(), (p - 1) / m)


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_bubble_interleaved(p, v):
    m = 4 * p
    # Per-stage times shrink by v: each rank holds v stages of 1/v the layers.
    timeline = simulate(interleaved_1f1b(p, m, v), {"F": 1.0 / v, "B": 2.0 / v})
    assert _close(timeline.bubble_fraction(), (p - 1) / (v * m))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubble_zb_h1(p):
    m = 4 * p
    assert _close(simulate(zb_h1(p, m), FIW).bubble_fraction(), (p - 1) / (3 * m))
    assert simulate(zb_h1(p, m), FIW).makespan < simulate(one_f_one_b(p, m), FB).makespan


def test_single_rank_has_no_bubble():
    for name in ["gpipe", "1f1b", "zb-h1"]:
        assert simulate(make_schedule(name, 1, 4), {**FB, **FIW}).bubble_fraction() == 0.0


# Timing model


def test_p2p_time_delays_the_receiver():
    timeline = simulate(one_f_one_b(2, 1), FB, p2p_time=0.5)
    # F on rank 0, transfer, F and B on rank 1, transfer, B on rank 0
    assert timeline.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_events_respect_order_and_dependencies():
    sched = interleaved_1f1b(4, 8, 2)
    timeline = simulate(sched, FB, p2p_time=0.1)
    assert len(timeline.events) == sum(a.is_compute for acts in sched.actions for a in acts)
    end = {e.action: e.end for e in timeline.events}
    start = {e.action: e.start for e in timeline.events}
    for e in timeline.events:
        s, k = e.action.stage, e.action.mb
        if e.action.kind is Kind.F and s > 0:
            assert e.start >= end[Action(s - 1, Kind.F, k)]
        if e.action.kind is Kind.B and s < sched.num_stages - 1:
            assert e.start >= end[Action(s + 1, Kind.B, k)]
    for rank in range(sched.num_ranks):
        mine = sorted((start[e.action], e.end) for e in timeline.events if e.rank == rank)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(mine, mine[1:]))


def test_callable_durations_and_busiest_rank():
    slow_stage = 1
    timeline = simulate(one_f_one_b(2, 4), lambda a: (3.0 if a.stage == slow_stage else 1.0))
    assert timeline.busy(1) == pytest.approx(4 * 2 * 3.0)
    assert timeline.busy(0) == pytest.approx(4 * 2 * 1.0)
    # ideal is the busiest rank: (makespan - 24) / 24
    assert timeline.bubble_fraction() == pytest.approx((timeline.makespan - 24.0) / 24.0)


def test_bad_durations_are_rejected():
    with pytest.raises(ValueError, match="no entry for 'W'"):
        simulate(zb_h1(2, 2), {"F": 1.0, "I": 1.0})
    with pytest.raises(ValueError, match="negative duration"):
        simulate(one_f_one_b(2, 2), {"F": 1.0, "B": -1.0})


# Memory


def test_peak_inflight_and_bytes():
    p, m = 4, 8
    sizes = {s: 10.0 * (s + 1) for s in range(p)}
    timeline = simulate(one_f_one_b(p, m), FB, activation_bytes=sizes)
    assert timeline.peak_inflight == (4, 3, 2, 1)
    assert timeline.peak_activation_bytes == tuple(n * sizes[r] for r, n in enumerate((4, 3, 2, 1)))
    assert simulate(gpipe(p, m), FB).peak_inflight == (m,) * p
    assert simulate(gpipe(p, m), FB).peak_activation_bytes == (0.0,) * p


def test_measured_timeline_from_events():
    a, b = Action(0, Kind.F, 0), Action(0, Kind.B, 0)
    events = [Event(0, a, 100.0, 101.0), Event(0, b, 102.0, 104.0), Event(1, a, 101.0, 102.0)]
    timeline = Timeline.from_events(events)
    assert timeline.makespan == 4.0 and timeline.num_ranks == 2
    assert timeline.bubble_fraction() == pytest.approx((4.0 - 3.0) / 3.0)


# Export


def test_chrome_trace(tmp_path):
    predicted = simulate(one_f_one_b(2, 4), FB)
    measured = simulate(zb_h1(2, 4), FIW)
    path = tmp_path / "trace.json"
    to_chrome_trace({"predicted": predicted, "measured": measured}, path)
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == len(predicted.events) + len(measured.events)
    names = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"predicted", "measured"}
    assert {e["tid"] for e in spans} == {0, 1}
    first = min((e for e in spans if e["pid"] == 0), key=lambda e: e["ts"])
    assert (first["name"], first["ts"], first["dur"]) == ("0F0", 0.0, 1e6)


def test_gantt_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gantt.png"
    plot_gantt({"1f1b": simulate(one_f_one_b(2, 4), FB), "zb-h1": simulate(zb_h1(2, 4), FIW)}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
