"""Calibration's timing harness, microbenchmarks and fits, small enough for the unit suite."""

import dataclasses

import pytest

from cost_model.calibration import bench_comm, bench_compute, calibrate, fitting
from cost_model.hardware.cluster import PER_ELEMENT_RULES, PRESETS
from cost_model.hardware.comm import KINDS


def test_median_time_uses_the_thread_clock_on_cpu(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setitem(bench_compute.CLOCKS, "thread", lambda: next(ticks))
    calls = []
    # Each repetition reads the clock twice (one tick apart) around `inner` calls.
    assert bench_compute.median_time(lambda: calls.append(1), "cpu", reps=3, inner=2) == 0.5
    assert len(calls) == 1 + 3 * 2  # one warm-up call, then reps x inner


def test_attention_flops_follow_the_cost_model_convention():
    # Causal forward 4bhs^2d / 2, backward 2.5x that (op_rules / op_graph).
    assert bench_compute.attention_flops(1, 2, 8, 4) == pytest.approx(3.5 * 4 * 2 * 64 * 4 / 2)


def test_interleaved_medians_warm_up_each_then_time_in_rounds():
    calls, rounds = [], []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    times = bench_compute.interleaved_medians(fns, "cpu", rounds=3, on_round=rounds.append)
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert calls == ["a", "b"] * 4 and rounds == [0, 1, 2]


def test_matmul_fit_separates_rate_from_per_call_overhead():
    rate, overhead = 80e9, 3e-4
    flops = [6 * m * n * k for m, n, k in calibrate.CPU_MATMULS]
    seconds = [2 * overhead + f / rate for f in flops]
    fitted_rate, fitted_overhead = fitting.fit_matmul(flops, seconds)
    assert fitted_rate == pytest.approx(rate, rel=1e-4)
    assert fitted_overhead == pytest.approx(overhead, rel=1e-3)


def test_compute_microbenchmarks_run():
    assert bench_compute.measure_linear(32, 16, 8, reps=1) > 0
    assert bench_compute.measure_attention(1, 2, 16, 8) > 0


def test_per_element_probes_time_forward_and_backward_apart():
    """Each per-element rule's forward and forward + backward run as training runs them, and
    calibration turns their times into seconds per element of each pass."""
    from cost_model.calibration.calibrate import _per_element_fields
    steps = [bench_compute.per_element_steps(rule) for rule in PER_ELEMENT_RULES]
    for forward, step, elements in steps:
        forward(), step()
        assert elements > 0
    seconds = [1e-4, 4e-4] * len(steps)
    fields = _per_element_fields(seconds, [n for _, _, n in steps])
    for rule, (_, _, n) in zip(PER_ELEMENT_RULES, steps):
        assert fields[f"{rule}_fwd"] == pytest.approx(1e-4 / n)
        assert fields[f"{rule}_bwd"] == pytest.approx(3e-4 / n)
    assert set(fields) <= {f.name for f in dataclasses.fields(PRESETS["cpu-gloo"])}


def test_fit_links_skips_kinds_without_data():
    truth = dataclasses.replace(PRESETS["cpu-gloo"], comm_corrections=())
    rows = [("all_reduce", 2, size, 1e-4 + size / 1e9) for size in (4096, 2**20)]
    fields = fitting.fit_links(truth, rows)
    assert set(fields["comm_corrections"]) == {"all_reduce"}


@pytest.mark.dist
def test_measure_collectives_times_every_kind():
    plan = [(kind, 4096) for kind in KINDS]
    steps = []
    times = bench_comm.measure_collectives(plan, 2, rounds=2, on_progress=steps.append)
    assert len(times) == len(plan) and all(t > 0 for t in times)
    assert steps == ["warm-up", "round 1/2", "round 2/2"]
    assert len(steps) == bench_comm.collective_steps(2)


def test_measure_collectives_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        bench_comm.measure_collectives([("all_reduce", 4096)], 1)
    with pytest.raises(ValueError, match="rounds"):
        bench_comm.measure_collectives([("all_reduce", 4096)], 2, rounds=0)
    with pytest.raises(ValueError, match="kind"):
        bench_comm.measure_collectives([("broadcast", 4096)], 2)
