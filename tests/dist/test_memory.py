"""Per-rank memory of every plan kind: the planner's prediction and the dry run against the
rank programs measured on real gloo ranks (planner.bench.memory_cases; the table in
docs/fidelity.md, "Memory")."""
import pytest

from planner.bench.memory import STATIC
from planner.bench.memory_cases import CASES, run_case

BOUNDS = {"static": 0.05, "total": 0.10, "dry": 0.02}


def _off(case, what: str, value: float, truth: float) -> str | None:
    """Why `value` is not within the bound of `truth`, or None when it is."""
    bound = BOUNDS[what]
    if abs(value / truth - 1) <= bound:
        return None
    return (f"{case.name}: {what} {value / 2**20:.3f} MiB against {truth / 2**20:.3f} MiB "
            f"measured ({value / truth - 1:+.1%}, bound {bound:.0%})")


def _dry_misses(result) -> list[str]:
    """The ranks whose dry run is off their measured peak, with both splits by category."""
    return [f"{why}; measured {m.split}, dry {d.split}"
            for m, d in zip(result.measured, result.dry)
            if (why := _off(result.case, "dry", d.peak_bytes, m.peak_bytes))]


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_predicted_and_dry_run_against_measured(case, pool2, pool4):
    result = run_case(case, {2: pool2, 4: pool4}[case.gpus])
    for predicted, measured in zip(result.predicted, result.measured):
        for what, value, truth in (
                ("static", sum(predicted[k] for k in STATIC), measured.static_bytes),
                ("total", sum(predicted.values()), measured.peak_bytes)):
            assert (why := _off(case, what, value, truth)) is None, why
    misses = _dry_misses(result)
    assert not misses, " | ".join(misses)


def _held_worker(hold: bool, spec, plan_json: str) -> int:
    """This rank's measured peak, with the last reduced gradient buffer referenced a while
    longer when `hold` (as a backend's worker thread holding the finished work does)."""
    import runtime.data_parallel.sharded_dp as sdp
    from planner.bench.memory import measure_worker
    finish, held = sdp._Bucket.finish_reduce, []

    def holding(bucket):
        if hold and bucket.inflight is not None:
            held[:] = [bucket.inflight[2]]
        return finish(bucket)
    sdp._Bucket.finish_reduce = holding
    try:
        return measure_worker(spec, plan_json, 2).peak_bytes
    finally:
        sdp._Bucket.finish_reduce = finish


@pytest.mark.dist
def test_a_reduced_gradient_is_freed_when_its_reduction_is_waited_on(pool4):
    """ZeRO-3 under a split backward: a unit's flat gradient is freed once its reduction is
    waited on, whoever still references it (gloo's worker thread drops the finished work only
    after the wait returns: left to reference counting, a whole unit's gradient more, at a
    moment that varied from run to run)."""
    from planner.bench.memory_cases import case_plan, case_spec
    case = next(c for c in CASES if c.name == "pp zb-h1 record zero-3")
    plan, spec = case_plan(case).dumps(), case_spec(case)
    assert pool4.run(_held_worker, True, spec, plan) == pool4.run(_held_worker, False, spec, plan)
