"""Per-rank memory of every plan kind: the planner's prediction and the dry run against the
rank programs measured on real gloo ranks (planner.bench.memory_cases; the table in
docs/fidelity.md, "Memory")."""
import warnings

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
    pool = {2: pool2, 4: pool4}[case.gpus]
    result = run_case(case, pool)
    for predicted, measured in zip(result.predicted, result.measured):
        for what, value, truth in (
                ("static", sum(predicted[k] for k in STATIC), measured.static_bytes),
                ("total", sum(predicted.values()), measured.peak_bytes)):
            assert (why := _off(case, what, value, truth)) is None, why
    misses = _dry_misses(result)
    if misses:
        # Once, on a loaded machine, a pipeline rank under ZeRO-3 measured 0.18 MiB (4%) above
        # its dry run, which thirty runs here, with random delays around every wait, did not
        # repeat. A second measurement tells a transient from a dry run that is off: the
        # first is reported as a warning, with both splits, and the second must agree.
        warnings.warn("first measurement off, measured again: " + " | ".join(misses))
        result = run_case(case, pool)
        misses = _dry_misses(result)
    assert not misses, " | ".join(misses)
