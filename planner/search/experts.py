"""Expert parallelism as a search axis: for each EP size the model's experts divide, the
ordinary search (planner.search.meshes) runs with every MoE block priced for that ep; the fastest
plans over all sizes win.

What ep changes in a MoE block's per-micro-batch price (cost_model.ops.moe.ExpertPricing):

  time         + the all-to-all of dispatch and combine, forward and backward: four exchanges of
                 the rank's T k h d bytes over an EP group of ep ranks at stride tp (the EP group
                 is consecutive dp x cp ranks; crosses nodes when (ep - 1) tp >= GPUs per node)
               + (imbalance - 1) x the experts' compute: the most loaded rank sets the pace
                 (1 under a benchmark's round-robin gate, Cluster.round_robin_routing)
               + the experts' grouped GEMMs repriced: E/ep experts of ep times the rows each,
                 1/ep of the weights read (`_expert_gemm_change`)
  memory       - expert weights: a rank holds E/ep experts (their gradients and optimizer states
                 too), whole under every ZeRO level (the runtime keeps them out of the sharded
                 buckets: ModelCosts.block_option adds back what the level's shares took off);
                 the activations of the routed slots grow by the imbalance factor
  dp traffic   expert gradients are summed over dp x cp / ep ranks; the search prices the
               rank's (smaller) gradient bytes over the whole dp group, an upper bound

The EP sizes tried divide every MoE layer's expert count and are at most the GPUs; a mesh whose
dp x cp ep does not divide is refused with the reason (planner.search.meshes.mesh_refusal). Under
context parallelism a rank routes its seq / cp tokens of each sequence, and a balance loss's
statistics are all-reduced over the cp group (priced with the block: cost_model.layers.layer_cost.price),
so cp is searched for MoE models like any other.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from cost_model.hardware.cluster import Cluster
from cost_model.hardware.comm import expert_dispatch_time
from cost_model.hardware.compute import compute_time
from cost_model.ops.graph_facts import BWD_FACTOR
from cost_model.layers.layer_cost import LayerCost
from cost_model.ops.moe import MoEFacts, facts, pricing
from passes.rewrite.expert_parallel import moe_nodes


def moe_facts(costs) -> dict[int, list[MoEFacts]]:
    """kind -> the MoEFacts of its moe_ffn nodes (at the captured batch); empty for a dense
    model."""
    gm = costs.captured.gm
    nodes = {n.name: n for n in moe_nodes(gm)}
    found = {}
    for kind, layer in enumerate(costs.kinds):
        mine = [facts(nodes[name]) for name in layer.nodes if name in nodes]
        if mine:
            found[kind] = mine
    return found


def ep_sizes(costs, gpus: int, fixed: int | None = None) -> list[int]:
    """EP sizes to try: divisors of the gcd of the expert counts, at most the GPUs; [1] for a
    dense model. A fixed ep must divide the experts: the error names the legal sizes."""
    found = moe_facts(costs)
    if not found:
        if fixed not in (None, 1):
            raise ValueError(f"ep={fixed}: the model has no mixture-of-experts layer (legal ep: 1)")
        return [1]
    experts = math.gcd(*(f.experts for fs in found.values() for f in fs))
    legal = [d for d in range(1, min(experts, gpus) + 1) if experts % d == 0]
    if fixed is not None:
        if fixed not in legal:
            raise ValueError(f"ep={fixed} does not divide the {experts} experts over at most "
                             f"{gpus} GPUs; legal ep: {', '.join(map(str, legal))}")
        return [fixed]
    return legal


@dataclasses.dataclass(frozen=True, eq=False)
class EPPricing:
    """The hook ModelCosts.price_block calls: a MoE kind's LayerCost at this ep. Compared and
    hashed by identity: ModelCosts caches the prices of each instance."""

    ep: int
    by_kind: dict
    captured_batch: int
    imbalance: float | None = None

    def expert_params(self, kind: int) -> float:
        """Expert weights one rank holds in a block of `kind` (3 E h f / ep per MoE layer)."""
        return self._expert_params.get(kind, 0)

    @functools.cached_property
    def _expert_params(self) -> dict[int, float]:
        return {kind: sum(f.expert_param_bytes / f.dtype_bytes / self.ep for f in layers)
                for kind, layers in self.by_kind.items()}

    def __call__(self, cost: LayerCost, micro_batch: int, cluster: Cluster, tp: int,
                 kind: int, cp: int = 1) -> LayerCost:
        layers = self.by_kind.get(kind)
        if not layers or self.ep == 1 and self.imbalance in (None, 1.0):
            return cost
        scale = micro_batch / self.captured_batch / cp   # a rank routes its 1/cp of the tokens
        for f in layers:
            cost = _with_ep(cost, dataclasses.replace(f, tokens=int(f.tokens * scale)), self.ep,
                            tp, cluster, self.imbalance, scale)
        return cost


def _with_ep(cost: LayerCost, f: MoEFacts, ep: int, tp: int, cluster: Cluster,
             imbalance: float | None, scale: float = 1.0) -> LayerCost:
    if imbalance is None and cluster.round_robin_routing:
        imbalance = 1.0          # round-robin routing loads every expert equally
    p = pricing(f, ep, imbalance=imbalance)
    a2a = expert_dispatch_time(cluster, f.tokens, f.top_k, f.hidden * f.dtype_bytes, ep,
                               stride=tp, group_limit=f.group_limit, experts=f.experts)
    flop_s = cluster.peak_flops * cluster.matmul_eff
    extra = p.extra_expert_flops / flop_s
    gemm_fwd, gemm_bwd = _expert_gemm_change(f, ep, cluster, scale)
    if cost.strategy.recompute == "full":
        gemm_bwd += gemm_fwd      # the backward runs the experts' forward again
    expert_params = p.param_bytes_saved / f.dtype_bytes / 1.0
    return dataclasses.replace(
        cost, fwd_s=cost.fwd_s + 2 * a2a + extra + gemm_fwd,
        bwd_s=cost.bwd_s + 2 * a2a + 2 * extra + gemm_bwd,
        comm_s=cost.comm_s + 4 * a2a,
        act_bytes=cost.act_bytes + p.extra_activation_bytes,
        params=int(cost.params - expert_params),
        comm_bytes=cost.comm_bytes + (("all_to_all", p.comm_bytes),) if ep > 1 else
        cost.comm_bytes)


def _expert_gemm_change(f: MoEFacts, ep: int, cluster: Cluster,
                        scale: float) -> tuple[float, float]:
    """(forward, backward) seconds the experts' grouped GEMMs change by at ep (negative: faster).
    The ep = 1 price (cost_model.ops.moe.moe_rule, scaled to the micro-batch by `scale` as
    layer_cost.price scales every op, its bytes included) runs the rank's T k slots as E GEMMs of
    T k / E rows and reads every expert's weights; under ep its E/ep experts take the slots of
    the whole group, ep times the rows each, which fill the GPU's tiles better
    (compute.gemm_efficiency), and it reads 1/ep of the weights, once: a layer of many experts
    that one rank's slots leave memory-bound at ep = 1 (Kimi K2's 384, 34 GB) is compute-bound
    at its ep. Both sides are the op's roofline (compute.compute_time), backward BWD_FACTOR
    times the forward's FLOPs and bytes, as moe_rule counts them."""
    if ep == 1:
        return 0.0, 0.0
    rows = float(f.tokens * f.top_k)
    token_bytes = 2.0 * f.tokens * f.hidden * f.dtype_bytes * (1 + f.top_k)

    def seconds(groups: int, weights: float, factor: float) -> float:
        return compute_time(cluster, factor * f.expert_flops, factor * (token_bytes + weights),
                            "matmul", gemm=(rows, f.ffn, f.hidden, groups))
    local = max(1, f.experts // ep)
    return tuple(seconds(local, f.expert_param_bytes / ep, k)
                 - seconds(f.experts, f.expert_param_bytes * scale, k) for k in (1.0, BWD_FACTOR))


def search_experts(costs, req, search, imbalance: float | None = None) -> list:
    """`search(costs, req)` for every EP size, each plan marked with its ep; the req.top_k
    fastest. Dense models: one plain search."""
    fixed = req.fix.get("ep")
    sizes = ep_sizes(costs, req.gpus, fixed)
    if sizes == [1] and imbalance is None:
        return search(costs, dataclasses.replace(req, fix=_without_ep(req.fix)))
    by_kind = moe_facts(costs)
    if not by_kind:
        raise ValueError(f"moe_imbalance (--moe-imbalance) {imbalance:g} states how unevenly a "
                         f"mixture of experts routes; the model has no mixture-of-experts layer: "
                         f"leave it out")
    plain = dataclasses.replace(req, fix=_without_ep(req.fix))
    # One pricing per size, kept: ModelCosts caches prices per pricing, and the candidates
    # that bound a size are the ones its search goes through.
    pricings = {ep: ep_pricing(costs, ep, imbalance, by_kind) for ep in sizes}
    found, plans = {}, []
    try:
        for ep in sizes:
            found[ep] = _candidates(costs, plain, ep, pricings[ep])
        # Most promising size first (least lower bound); a size whose bound cannot beat the
        # k-th plan found is skipped, and each search stops at that plan's time.
        for bound, ep in sorted((_bound(found[ep]), ep) for ep in sizes):
            kth = plans[req.top_k - 1].predicted.iteration_s if len(plans) >= req.top_k \
                else math.inf
            if bound >= kth:
                continue
            set_ep(costs, ep, pricings[ep], req.cluster)
            best = search(costs, dataclasses.replace(plain, cutoff_s=kth), found[ep])
            plans = sorted(plans + [dataclasses.replace(p, ep=ep) for p in best],
                           key=lambda p: (p.predicted.iteration_s, p.ep))
    finally:
        set_ep(costs, 1, None)
    return plans[: req.top_k]


def ep_pricing(costs, ep: int, imbalance: float | None = None,
               by_kind: dict | None = None) -> EPPricing | None:
    """The hook that prices a MoE block at `ep`, or None where blocks are priced as captured:
    at ep = 1 without a stated imbalance no expert is cut, and the runtime holds and shards the
    experts as it does the rest of the model (the same price as a search with ep=1 fixed)."""
    if ep == 1 and imbalance is None:
        return None
    return EPPricing(ep, moe_facts(costs) if by_kind is None else by_kind,
                     costs.captured.batch, imbalance)


def set_ep(costs, ep: int, pricing: EPPricing | None, cluster: Cluster | None = None) -> None:
    """Price `costs` at `ep` from now on (set_ep(costs, 1, None) restores the captured prices);
    `cluster` says how its runtime holds the experts' states (Cluster.shards_experts)."""
    costs.ep, costs.ep_pricing = ep, pricing
    costs.shards_experts = bool(cluster and cluster.shards_experts)


def _candidates(costs, req, ep: int, pricing: EPPricing | None) -> list:
    """The configurations at this ep, best bound first (planner.search.meshes.candidates)."""
    from planner.search.meshes import candidates
    set_ep(costs, ep, pricing, req.cluster)
    return candidates(costs, req)


def _bound(found: list) -> float:
    """The least lower bound of any configuration."""
    return found[0].lower_bound if found else math.inf


def _without_ep(fix: dict) -> dict:
    return {k: v for k, v in fix.items() if k != "ep"}
