"""What the outer search's lower bound assumes of the cost model, and that it holds."""
import functools

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
    """planner.search.meshes._LeastCosts prices only recompute-free strategies for its bounds."""
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
    assert _with_search_gap(best, 0.9 * time_s).solver == \
        "feasible, gap 10.00%, stopped by the node limit"
    own = with_(best, solver="feasible, gap 12.00%, stopped by the node limit")
    assert _with_search_gap(own, 0.9 * time_s).solver == \
        "feasible, gap 12.00%, stopped by the node limit"
    assert _with_search_gap(own, 0.9 * time_s, timed_out=True).solver == \
        "feasible, gap 12.00%, stopped by the time limit (a rerun may plan differently)"


def _reference_candidates(costs, req):
    """planner.search.meshes.candidates as first written: each configuration's least costs and
    bound worked out afresh, from the strategies' prices (the search memoises them)."""
    from cost_model.layers.sharding import Sharding
    from planner.search import meshes, problem

    def sync(c, least):
        _, parts, units = problem.comm_terms(costs, req, c)
        grads = (least.blocks_grad_bytes + least.end_grad_bytes) / c.pp
        return problem.least_sync(parts, units, grads, req.cluster)

    found = []
    for c in meshes.configurations(costs, req):
        memory = Sharding(c.zero, (c.dp_shard or c.dp) * c.cp if c.zero else 1)
        twins = sorted({replace(s, recompute="none")
                        for s in problem.strategies(req, c.tp, costs, c.cp)})
        kinds = []
        for kind in range(len(costs.kinds)):
            options = [costs.block_option(costs.price_block(s, c.micro_batch, req.cluster, c.tp,
                                                            c.cp, kind), memory) for s in twins]
            kinds.append([min(getattr(o, term) for o in options)
                          for term in ("time_s", "static_bytes", "grad_bytes")])
        embed, head = (costs.end_layer(end, memory) for end in costs.end_costs(
            c.micro_batch, req.cluster, padded=True, cp=c.cp, tp=c.tp))
        def total(term):
            return sum(n * kinds[kind][term] for kind, n in costs.runs)
        if (total(1) + embed.static_bytes + head.static_bytes) / c.pp > req.memory_limit:
            continue
        least = meshes._Least(min(k[0] for k in kinds), embed.time_s, head.time_s,
                              embed.grad_bytes + head.grad_bytes, total(0), total(2))
        plain = replace(c, zero=0, dp_shard=0)
        bound = meshes._lower_bound(costs, req, plain, least, *problem.comm_terms(costs, req,
                                                                                   plain))
        if c.zero or c.dp_shard:
            bound += sync(c, least) - sync(plain, least)
        found.append(replace(c, lower_bound=bound))
    return sorted(found, key=lambda c: (c.lower_bound, c.pp, c.tp, c.cp, c.v, c.split_backward))


@functools.lru_cache(maxsize=None)
def _captured(model: str, fp32: bool):
    return _model_costs(model, None, None, None, fp32=fp32)


@pytest.mark.parametrize("model,gpus,cluster,ep", [("gpt2-small", 32, "a100-80g-dgx", 1),
                                                   ("deepseek-tiny", 16, "h100-sxm-dgx", 2),
                                                   ("gpt-tiny", 8, "cpu-gloo", 1)])
@pytest.mark.parametrize("gib", [80.0, 0.5])
def test_the_memoised_candidates_are_the_configurations_bounded_one_by_one(model, gpus, cluster,
                                                                          ep, gib):
    """candidates() prices each (tp, cp, micro-batch) once and each static-memory layout once per
    ZeRO level: the same candidates, bounds and order, to the bit, as pricing each one afresh."""
    from planner.search import experts
    from planner.search.meshes import Request, candidates

    hw = get_cluster(cluster)
    moe, name, batch, seq = _captured(model, hw.runtime_priced)
    if ep > 1:
        moe.ep, moe.ep_pricing = ep, experts.EPPricing(ep, experts.moe_facts(moe),
                                                       moe.captured.batch)
    try:
        req = Request(gpus, hw, batch, seq, gib * 2**30, name)
        found = candidates(moe, req)
        assert found and found == _reference_candidates(moe, req)
    finally:
        moe.ep, moe.ep_pricing = 1, None


def test_the_lightest_twin_holds_the_least_static_bytes_at_every_zero_level():
    """candidates() filters on the static bytes of each kind's twin with the fewest parameters:
    static bytes grow with the parameters under every ZeRO level, expert weights included."""
    from cost_model.layers.sharding import Sharding
    from planner.search import experts

    moe = _captured("deepseek-tiny", False)[0]
    hw = get_cluster("h100-sxm-dgx")
    moe.ep, moe.ep_pricing = 2, experts.EPPricing(2, experts.moe_facts(moe), moe.captured.batch)
    for tp, kind, memory in [(1, 1, Sharding()), (2, 1, Sharding(1, 4)), (2, 0, Sharding(3, 8)),
                             (4, 1, Sharding(2, 2)), (4, 0, Sharding(3, 16))]:
        twins = [moe.price_block(s, 2, hw, tp, 1, kind) for s in strategy_space(tp)
                 if s.recompute == "none"]
        lightest = min(twins, key=lambda c: c.params)
        assert moe.block_static(lightest, memory) == min(moe.block_option(c, memory).static_bytes
                                                         for c in twins)
    moe.ep, moe.ep_pricing = 1, None


def test_prices_at_an_ep_size_are_its_hook_on_the_plain_price():
    """ModelCosts caches a block's price per EP pricing: what the hook makes of the plain price."""
    from planner.search import experts

    moe = _captured("deepseek-tiny", False)[0]
    hw = get_cluster("h100-sxm-dgx")
    for ep in (2, 4):
        pricing = experts.EPPricing(ep, experts.moe_facts(moe), moe.captured.batch)
        moe.ep, moe.ep_pricing = ep, pricing
        for s in strategy_space(2):
            plain = moe._price(s, 2, hw, 2, 1, 1)
            assert moe.price_block(s, 2, hw, 2, 1, 1) == pricing(plain, 2, hw, 2 if s.tp else 1,
                                                                 1, 1)
    moe.ep, moe.ep_pricing = 1, None


def test_search_given_its_candidates_plans_as_it_does_alone():
    """planner.search.experts hands each EP size's search the candidates that bounded it."""
    from planner.search.meshes import Request, candidates, search

    hw = get_cluster("a100-80g-dgx")
    small, name, batch, seq = _model_costs("gpt2-small", None, 64, None)
    req = Request(16, hw, batch, seq, float(hw.mem_bytes), name, top_k=3)
    alone = search(small, req)
    assert alone and search(small, req, candidates(small, req)) == alone
