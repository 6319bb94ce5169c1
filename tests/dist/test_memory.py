"""Per-rank memory of every plan kind: the planner's prediction and the dry run against the
rank programs measured on real gloo ranks (planner.bench.memory_cases; the table in
docs/fidelity.md, "Memory")."""
import pytest

from planner.bench.memory import STATIC
from planner.bench.memory_cases import CASES, run_case

BOUNDS = {"static": 0.05, "total": 0.10, "dry": 0.02}


def _within(case, what: str, value: float, truth: float) -> None:
    bound = BOUNDS[what]
    assert abs(value / truth - 1) <= bound, (
        f"{case.name}: {what} {value / 2**20:.3f} MiB against {truth / 2**20:.3f} MiB measured "
        f"({value / truth - 1:+.1%}, bound {bound:.0%})")


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_predicted_and_dry_run_against_measured(case, pool2, pool4):
    result = run_case(case, {2: pool2, 4: pool4}[case.gpus])
    for predicted, measured, dry in zip(result.predicted, result.measured, result.dry):
        _within(case, "static", sum(predicted[k] for k in STATIC), measured.static_bytes)
        _within(case, "total", sum(predicted.values()), measured.peak_bytes)
        _within(case, "dry", dry.peak_bytes, measured.peak_bytes)
