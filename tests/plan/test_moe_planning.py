"""Planning mixtures of experts: expert parallelism as a search axis, heterogeneous blocks
(dense first blocks, then MoE), the planner against hand-tuned configurations priced by --fix,
and what ep changes in a MoE block's price against cost_model.ops.moe's formulas."""
import dataclasses

import pytest

from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.comm import collective_time
from cost_model.layers.strategy import Strategy
from planner import api
from planner.search import experts as expert_search
from planner.api import plan

H100 = "h100-sxm-dgx"


def test_deepseek_v3_on_1024_gpus_beats_the_hand_tuned_configuration():
    best = plan("deepseek-v3", 1024, cluster=H100)[0]
    assert best.ep > 1 and (best.dp * best.cp) % best.ep == 0
    assert sum(len(s.layers) for s in best.stages) == 61 + 2
    hand = plan("deepseek-v3", 1024, cluster=H100,
                fix=dict(tp=2, pp=8, v=4, schedule="interleaved-1f1b", ep=64, mb=1, zero=1,
                         cp=1))[0]
    assert (hand.tp, hand.pp, hand.virtual_stages, hand.ep, hand.dp) == (2, 8, 4, 64, 64)
    assert best.predicted.iteration_s <= hand.predicted.iteration_s


def test_mixtral_8x7b_on_64_gpus_beats_tp1_pp4_ep8():
    best = plan("mixtral-8x7b", 64, cluster=H100)[0]
    hand = plan("mixtral-8x7b", 64, cluster=H100, fix=dict(tp=1, pp=4, ep=8, mb=1))[0]
    assert (hand.tp, hand.pp, hand.ep) == (1, 4, 8)
    assert best.predicted.iteration_s <= hand.predicted.iteration_s


def test_dense_first_blocks_then_moe_plan_in_order():
    best = plan("deepseek-tiny", 8, cluster="cpu-gloo", fix={"pp": 2})[0]
    layers = [name for stage in best.stages for name in stage.layers]
    assert layers == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]


def test_ep_prices_all_to_all_weights_and_imbalance_by_formula():
    costs, *_ = api._model_costs("mixtral-8x7b", None, None, None)
    # grouped kernels at a dense GEMM's rate: one expert a rank then runs the same GEMMs as the
    # ep = 1 price (their repricing is the next test's)
    cluster, ep, b = dataclasses.replace(get_cluster(H100), grouped_gemm_eff=1.0), 8, 1
    (facts,) = expert_search.moe_facts(costs)[0]
    base = costs.price_block(Strategy(), b, cluster, 1)
    costs.ep_pricing = expert_search.EPPricing(ep, expert_search.moe_facts(costs), 1, 1.25)
    try:
        priced = costs.price_block(Strategy(), b, cluster, 1)
    finally:
        costs.ep_pricing = None
    t, h, k, f, d = facts.tokens, facts.hidden, facts.top_k, facts.ffn, facts.dtype_bytes
    assert (t, h, k, f) == (4096, 4096, 2, 14336)
    assert base.params - priced.params == 3 * 8 * h * f * (1 - 1 / ep)
    assert dict(priced.comm_bytes)["all_to_all"] == 4 * t * k * h * d * (ep - 1) / ep
    a2a = collective_time(cluster, "all_to_all", t * k * h * d, ep)
    extra = 0.25 * 6 * t * k * h * f / (cluster.peak_flops * cluster.matmul_eff)
    assert priced.fwd_s - base.fwd_s == pytest.approx(2 * a2a + extra)
    assert priced.bwd_s - base.bwd_s == pytest.approx(2 * a2a + 2 * extra)
    # the most loaded rank's extra slots, and the combine's received rows (ep > 1)
    assert priced.act_bytes - base.act_bytes == pytest.approx(
        0.25 * t * k * (3 * h + 4 * f) * d + t * k * h * d)


def test_cp_prices_the_balance_all_reduce_and_routes_local_tokens():
    """Under cp a rank routes seq / cp tokens of each sequence (all-to-all bytes / cp) and
    all-reduces each MoE layer's balance statistics, 2 b E values, forward and backward."""
    from cost_model.hardware.comm import bytes_on_wire
    costs, *_ = api._model_costs("mixtral-8x7b", None, None, None)
    cluster, ep, b, cp = get_cluster(H100), 8, 1, 4
    assert costs.cp_error is None and costs.supports_cp(cp, 4096)
    (facts,) = expert_search.moe_facts(costs)[0]
    t, e, h, k, d = facts.tokens, facts.experts, facts.hidden, facts.top_k, facts.dtype_bytes
    plain = costs.price_block(Strategy(), b, cluster, 1)
    split = costs.price_block(Strategy(), b, cluster, 1, cp)
    stats = b * 2 * e * d
    assert "all_reduce" not in dict(plain.comm_bytes)
    assert dict(split.comm_bytes)["all_reduce"] == 2 * bytes_on_wire("all_reduce", stats, cp)
    assert split.comm_s >= 2 * collective_time(cluster, "all_reduce", stats, cp)
    full = costs.price_block(Strategy.parse("full"), b, cluster, 1, cp)
    assert dict(full.repeated_bytes)["all_reduce"] == bytes_on_wire("all_reduce", stats, cp)
    costs.ep_pricing = expert_search.EPPricing(ep, expert_search.moe_facts(costs), 1, 1.0)
    try:
        priced = costs.price_block(Strategy(), b, cluster, 1, cp)
    finally:
        costs.ep_pricing = None
    assert dict(priced.comm_bytes)["all_to_all"] == 4 * (t // cp) * k * h * d * (ep - 1) / ep


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
def test_moe_models_with_a_balance_loss_plan_with_cp(name):
    from planner.models.presets import get_config
    assert get_config(name).aux_loss > 0
    best = plan(name, 8, cluster="cpu-gloo", fix={"cp": 2, "ep": 2, "pp": 2})[0]
    assert (best.cp, best.ep, best.pp) == (2, 2, 2)


def test_imbalance_override_slows_the_plan():
    fix = dict(tp=1, pp=4, ep=8)
    even = plan("mixtral-8x7b", 64, cluster=H100, fix=fix, moe_imbalance=1.0)[0]
    skewed = plan("mixtral-8x7b", 64, cluster=H100, fix=fix, moe_imbalance=1.5)[0]
    assert skewed.predicted.iteration_s > even.predicted.iteration_s


def test_bad_ep_is_refused_with_the_legal_sizes():
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts.*legal ep: 1, 2, 4, 8"):
        plan("mixtral-8x7b", 64, cluster=H100, fix={"ep": 3})
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        plan("llama-tiny", 4, cluster="cpu-gloo", fix={"ep": 2})


def test_plan_json_round_trips_ep():
    best = plan("mixtral-tiny", 4, cluster="cpu-gloo", fix={"ep": 4})[0]
    assert best.ep == 4 and best.to_json()["mesh"]["ep"] == 4
    again = type(best).from_json(best.dumps())
    assert again == best and again.layout().ep == 4
    dense = dataclasses.replace(best, ep=1)
    assert "ep" not in dense.to_json() and "ep" not in dense.to_json()["mesh"]


def test_ep_reprices_the_expert_gemms_at_the_groups_rows_and_weights():
    """At ep = 1 a rank's slots spread over all 256 experts (128 rows each) and it reads all 22.5
    GB of expert weights: memory-bound. Under ep its E/ep experts take the whole group's slots
    and it reads 1/ep of the weights: the GEMMs' roofline, compute-bound. No mesh prices a block
    below zero (cp and larger micro-batches scale the ep = 1 price, bytes included)."""
    from cost_model.hardware.compute import gemm_efficiency
    costs, *_ = api._model_costs("deepseek-v3", None, None, None)
    cluster = get_cluster(H100)
    (facts,) = expert_search.moe_facts(costs)[1]
    t, h, k, f, d = facts.tokens, facts.hidden, facts.top_k, facts.ffn, facts.dtype_bytes
    base = costs.price_block(Strategy(), 1, cluster, 1, 1, 1)
    weights = facts.expert_param_bytes
    memory_bound = (2 * t * h * d * (1 + k) + weights) / (cluster.mem_bw * cluster.bw_eff)
    for ep, cp, mb in [(64, 1, 1), (8, 1, 2), (128, 16, 1), (16, 4, 2), (256, 4, 4)]:
        costs.ep_pricing = expert_search.EPPricing(ep, expert_search.moe_facts(costs), 1, 1.0)
        try:
            priced = costs.price_block(Strategy(), mb, cluster, 1, cp, 1)
        finally:
            costs.ep_pricing = None
        assert priced.fwd_s > 0 and priced.bwd_s > 0, (ep, cp, mb)
        if (ep, cp, mb) == (64, 1, 1):
            compute = 6 * t * k * h * f / (cluster.peak_flops * cluster.matmul_eff
                                           * gemm_efficiency(cluster, t * k, f, h, 256 // ep)
                                           * cluster.grouped_gemm_eff)   # 4 experts a rank
            a2a = (priced.comm_s - base.comm_s) / 4
            assert priced.fwd_s - base.fwd_s == pytest.approx(2 * a2a + compute - memory_bound)


def test_runtimes_that_shard_experts_hold_their_states_over_the_expert_data_parallel_group():
    """Megatron's distributed optimizer and FSDP2 shard an expert's states over the ranks that
    hold the same experts (n / ep of a shard group of n); fxpar's runtime keeps them whole."""
    from cost_model.layers.sharding import Sharding
    costs, *_ = api._model_costs("mixtral-tiny", None, None, None)
    cluster, ep = get_cluster(H100), 4
    pricing = expert_search.EPPricing(ep, expert_search.moe_facts(costs), costs.captured.batch)
    costs.ep, costs.ep_pricing = ep, pricing
    try:
        cost = costs.price_block(Strategy(), 1, cluster, 1)
        experts = pricing.expert_params(costs._kind_of[cost.layer])
        opt = costs.training.optimizer_bytes()
        assert experts > 0
        for level, n, kept in [(1, 8, opt / 2), (3, 8, None), (1, 4, 0.0)]:
            memory = Sharding(level, n)
            whole = costs.block_static(cost, memory)
            costs.shards_experts = True
            sharded = costs.block_static(cost, memory)
            costs.shards_experts = False
            if kept is None:  # ZeRO-3: weights, gradients and states over n / ep = 2 ranks
                kept = (costs._per_param(1) - costs._per_param(Sharding(3, 2)))
            assert whole - sharded == pytest.approx(experts * kept)  # ep = n: nothing to shard
    finally:
        costs.ep, costs.ep_pricing, costs.shards_experts = 1, None, False
    fix = {"dp": 8, "ep": ep, "zero": 1, "pp": 1, "tp": 1, "cp": 1}
    own, megatron = (sum(plan("mixtral-tiny", 8, cluster=H100, runtime=r, fix=fix)[0]
                         .predicted.rank_memory[0][:3]) for r in ("fxpar", "megatron"))
    assert megatron < own
