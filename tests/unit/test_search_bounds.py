"""What the outer search's lower bound assumes of the cost model, and that it holds."""
import pytest

from cost_model.hardware.cluster import get_cluster
from cost_model.layers.strategy import strategy_space
from dataclasses import replace
from planner.api import _model_costs


@pytest.fixture(scope="module")
def costs():
    return _model_costs("gpt2-small", None, 32, None)[0]


@pytest.mark.parametrize("cluster", ["a100-80g-dgx", "cpu-gloo"])
@pytest.mark.parametrize("tp,cp,b", [(1, 1, 1), (2, 1, 4), (4, 2, 2), (2, 4, 1), (1, 2, 8)])
def test_recomputation_never_makes_a_block_faster_or_lighter_in_parameters(costs, cluster, tp,
                                                                            cp, b):
    """planner.search.meshes._least_costs prices only recompute-free strategies for its bound."""
    hw = get_cluster(cluster)
    for s in strategy_space(tp):
        cost = costs.price_block(s, b, hw, tp, cp)
        twin = costs.price_block(replace(s, recompute="none"), b, hw, tp, cp)
        assert cost.fwd_s + cost.bwd_s >= twin.fwd_s + twin.bwd_s
        assert cost.params == twin.params


def test_a_configuration_left_open_by_a_time_limit_turns_the_plan_into_a_gap():
    """search: a plan is "optimal" only if no configuration a time limit stopped could beat it."""
    from dataclasses import replace as with_
    from planner.api import plan
    from planner.search.meshes import _with_search_gap

    best = with_(plan("gpt-tiny", 8, cluster="cpu-gloo")[0], solver="optimal, gap 0.00%")
    time_s = best.predicted.iteration_s
    assert _with_search_gap(best, time_s) == best
    assert _with_search_gap(best, float("inf")) == best
    assert _with_search_gap(best, 0.9 * time_s).solver == "feasible, gap 10.00%"
    own = with_(best, solver="feasible, gap 12.00%")
    assert _with_search_gap(own, 0.9 * time_s).solver == "feasible, gap 12.00%"
