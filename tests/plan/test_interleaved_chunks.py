"""Interleaved 1F1B: the search's closed form against the schedule simulated with the plan's own
stage times (planner.search.ilp: even chunks, as Megatron-Core's equal layers per virtual
stage). A rank whose chunks are uneven waits on its slower chunk; the closed form, which prices
each rank's sum, holds only for even ones."""
import pytest

from planner.api import plan
from planner.models.presets import get_config
from planner.report.pictures import predicted_timeline
from runtime.pipeline.generators import make_schedule
from runtime.pipeline.simulator import simulate


def _simulated(times: list[float], p: int, v: int, m: int) -> float:
    schedule = make_schedule("interleaved-1f1b", p, m, v)
    return simulate(schedule, lambda a: times[a.stage] * (1 if a.kind.value == "F" else 2) / 3
                    ).makespan


def test_uneven_chunks_run_slower_than_each_rank_s_sum():
    """Why the search keeps chunks even: equal rank sums, chunks (0.5, 1.5) on every rank."""
    p, v, m = 8, 2, 64
    even = _simulated([1.0] * 16, p, v, m)
    uneven = _simulated([0.5] * 8 + [1.5] * 8, p, v, m)
    assert even == pytest.approx((m + (p - 1) / v) * 2.0)      # the closed form
    assert uneven > 1.25 * even


@pytest.mark.parametrize("pp,v", [(8, 2), (4, 4)])
def test_an_interleaved_plan_runs_as_it_is_priced(pp, v):
    chosen = plan(get_config("llama2-7b"), pp, cluster="h100-sxm-dgx",
                  fix={"pp": pp, "v": v, "dp": 1, "tp": 1, "schedule": "interleaved-1f1b"})[0]
    blocks = [sum(1 for layer in st.layers if layer not in ("embed", "head"))
              for st in chosen.stages]
    assert max(blocks) - min(blocks[1:-1]) <= 1, blocks
    simulated = predicted_timeline(chosen).makespan   # dp=1: the pipeline is the whole step
    assert simulated == pytest.approx(chosen.predicted.iteration_s, rel=0.01)
