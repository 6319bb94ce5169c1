"""`fxpar bench --rounds`: a plan's rounds combine into one result, and a bad count is refused;
the predictions that several runs of a plan leave within a tolerance."""
import pytest

from planner.bench.plans import Measured, attainable, bench, combined


def _measured(step_s: float, peak: float, rank: int = 0) -> Measured:
    return Measured(step_s=step_s, tokens_per_s=1024 / step_s, peak_memory_bytes=peak,
                    losses=(2.0, 1.5), ranks=({"rank": rank},))


def test_rounds_combine_into_the_median_step_and_the_largest_peak():
    runs = [_measured(0.30, 5.0, rank=0), _measured(0.10, 9.0, rank=1),
            _measured(0.20, 7.0, rank=2)]
    got = combined(runs)
    assert got.step_s == 0.20
    assert got.tokens_per_s == pytest.approx(1024 / 0.20)
    assert got.peak_memory_bytes == 9.0
    assert got.losses == (2.0, 1.5) and got.ranks == ({"rank": 2},)  # the median round's


def test_an_even_count_explains_the_faster_middle_round():
    runs = [_measured(0.30, 5.0, rank=0), _measured(0.10, 9.0, rank=1),
            _measured(0.24, 7.0, rank=2), _measured(0.12, 7.0, rank=3)]
    got = combined(runs)
    assert got.step_s == pytest.approx(0.18)
    assert got.ranks == ({"rank": 3},)  # 0.12 and 0.24 are the middle ones


def test_one_round_is_that_round():
    one = _measured(0.25, 3.0)
    assert combined([one]) == one


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench([], config=None, rounds=0)


def test_the_attainable_predictions_are_those_within_the_tolerance_of_every_run():
    low, high = attainable([40.0, 50.0, 45.0])
    assert (low, high) == pytest.approx((40.0, 48.0))
    for p in (low, high, 44.0):  # inside: within 20% of each run
        assert all(abs(p / m - 1) <= 0.20 + 1e-12 for m in (40.0, 50.0, 45.0))
    for p in (low * 0.99, high * 1.01):  # just outside: one run is missed
        assert any(abs(p / m - 1) > 0.20 for m in (40.0, 50.0, 45.0))


def test_runs_more_than_1_5x_apart_leave_no_prediction_within_20_percent():
    assert attainable([40.0, 59.0]) is not None  # 1.475x apart
    assert attainable([40.0, 61.0]) is None      # 1.525x apart
    assert attainable([40.0, 61.0], tolerance=0.25) is not None
