"""A candidate's stage problem: what the outer search (planner.search.meshes) asks the stage ILP
(planner.search.ilp) for one configuration. Its blocks priced under each strategy the request
allows (dominated ones pruned), the end layers, the runtime's own terms (ZB-H1's second backward
traversal, the optimizer step), the pipeline's p2p and the data-parallel collectives of a rank,
and the schedule's weights and activation factors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from cost_model.hardware.cluster import Cluster
from cost_model.hardware.comm import collective_time
from cost_model.hardware.device_memory import device_memory, groups_of
from cost_model.layers.layer_cost import LayerCost
from cost_model.layers.sharding import BACKWARD_SHARE, SyncParts
from cost_model.layers.sharding import peak_buffers
from cost_model.layers.strategy import Strategy, strategy_space
from planner.search import ilp
from planner.search import zero as zero_axis
from planner.search.costs import ModelCosts
from runtime.pipeline.generators import inflight_moments, peak_inflight

# (schedule, v) pairs the search tries; GPipe has 1F1B's time and more memory, so only a fix picks it.
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))


@dataclass(frozen=True)
class Request:
    gpus: int
    cluster: Cluster
    global_batch: int
    seq: int
    memory_limit: float
    model_name: str = "model"
    fix: dict = field(default_factory=dict)
    top_k: int = 5
    # per ILP, a backstop: highs.NODE_LIMIT stops a hard one alike in every run; either way
    # the plan reports its gap and which limit stopped it
    time_limit_s: float = 10.0
    schedules: tuple[tuple[str, int], ...] = SCHEDULES
    cutoff_s: float = math.inf     # plans no faster than this are not wanted (expert_search)
    sizes_from: str = ""           # where seq and global batch came from (the plan states it)
    sequences: bool = True         # False: inputs are not sequences, the plan counts samples


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int
    schedule: str
    v: int
    lower_bound: float
    cp: int = 1
    zero: int = 0          # sharded data parallel level (planner.search.zero)
    dp_shard: int = 0      # ranks per shard group; 0: dp (no hybrid sharding)
    split_backward: str = ""  # ZB-H1's W: "record", or "" walking the graph again


def strategies(req: Request, tp: int, costs: ModelCosts | None = None,
                cp: int = 1, kind: int | None = None) -> list[Strategy]:
    """The block strategies to consider at tp (and, given the model's costs, cp): the fix's, and
    with sequence parallelism only where the model's sequence admits it. For blocks of `kind`
    that tp does not divide where others do (costs.kind_tp_errors): whole on every rank of the
    tp group; for blocks of a part that takes tp but not sequence parallelism: tp alone."""
    space = strategy_space(tp)
    if "strategy" in req.fix:  # a user-fixed strategy for every block (e.g. Megatron's "tp")
        fixed = Strategy.parse(req.fix["strategy"])
        space = [fixed if tp > 1 or not fixed.tp else Strategy(recompute=fixed.recompute)]
    if "recompute" in req.fix:
        space = [s for s in space if s.recompute == req.fix["recompute"]] or \
                [Strategy(recompute=req.fix["recompute"])]
    if req.fix.get("split_backward") == "record":  # never recorded through a recomputed block
        space = [s for s in space if s.recompute == "none"]
    if costs is not None and any(s.sp for s in space) and not costs.supports_sp(tp, cp, req.seq):
        space = [s for s in space if not s.sp]
    if costs is not None and kind is not None and tp > 1 and not costs.shards(tp, kind):
        space = list(dict.fromkeys(Strategy(recompute=s.recompute) for s in space))
    elif costs is not None and kind is not None and any(s.sp for s in space) and \
            not costs.kind_sp(tp, kind):  # a part whose blocks take tp without sp
        space = list(dict.fromkeys(Strategy(s.tp, False, s.recompute) for s in space))
    return space


def block_costs(costs: ModelCosts, req: Request, tp: int, b: int, cp: int = 1,
                kind: int = 0) -> list[LayerCost]:
    return [costs.price_block(s, b, req.cluster, tp, cp, kind)
            for s in strategies(req, tp, costs, cp, kind)]


def _prune_dominated(options: list[ilp.BlockOption]) -> list[int]:
    """Indices of options no other option beats (≤ on every term, < on one)."""
    def key(o):
        return (o.time_s, o.static_bytes, o.act_bytes, o.grad_bytes)
    keep = []
    for i, o in enumerate(options):
        dominated = any(all(a <= b for a, b in zip(key(q), key(o))) and key(q) != key(o)
                        or (key(q) == key(o) and j < i) for j, q in enumerate(options))
        if not dominated:
            keep.append(i)
    return keep


def build_problem(costs: ModelCosts, req: Request, c: Candidate, memory_limit: float):
    """The stage ILP for a candidate, and the LayerCost behind each (non-dominated) option; with
    blocks of several kinds, one ilp.BlockRun per run and the LayerCosts in the problem's
    (flattened) option order."""
    per_kind = []
    for kind in range(len(costs.kinds)):
        blocks = block_costs(costs, req, c.tp, c.micro_batch, c.cp, kind)
        if records(req, c):  # never recorded through a recomputed block
            blocks = [cost for cost in blocks if cost.strategy.recompute == "none"]
        options = [runtime_terms(costs.block_option(cost, zero_axis.sharding_of(c)), cost, req, c,
                                 costs)
                   for cost in blocks]
        keep = _prune_dominated(options)
        per_kind.append(([options[i] for i in keep], [blocks[i] for i in keep]))
    ends = costs.end_costs(c.micro_batch, req.cluster, padded=True, cp=c.cp, tp=c.tp)
    memory_limit = tensor_limit(costs, req, c, memory_limit)
    if len(costs.runs) == 1:
        options, blocks = per_kind[0]
        return stage_problem(costs, req, c, tuple(options), ends, memory_limit,
                             layer_costs=blocks), blocks
    runs = tuple(ilp.BlockRun(costs.kinds[kind].name, n, tuple(per_kind[kind][0]))
                 for kind, n in costs.runs)
    blocks = [cost for kind, _ in costs.runs for cost in per_kind[kind][1]]
    return stage_problem(costs, req, c, (), ends, memory_limit, runs, blocks), blocks


def stage_problem(costs: ModelCosts, req: Request, c: Candidate, options: tuple, ends,
                  memory_limit: float, runs: tuple = (), layer_costs=()) -> ilp.StageProblem:
    """The stage ILP of a candidate for given block options (or runs of blocks of several kinds,
    ilp.BlockRun) and end-layer costs (embed, head); `layer_costs`, the options' LayerCosts,
    give each rank's largest temporary (`memory_terms`)."""
    tied = _tied_local(costs, req, c)
    whole = tied if _keeps_tied_whole(req) else 0.0
    embed, head = (runtime_terms(costs.end_layer(cost, zero_axis.sharding_of(c), whole), cost,
                                 req, c, costs)
                   for cost in ends)
    head = _untied(costs, req, c, head, tied)
    p2p, parts, units = comm_terms(costs, req, c)
    weights = ilp.schedule_weights(c.schedule, c.pp, c.microbatches, c.v)
    inflight = peak_inflight(c.schedule, c.pp, c.microbatches, c.v)
    phi = tuple(f / c.v for f in inflight)
    cluster = req.cluster
    temp, lazy = memory_terms(c, inflight, layer_costs, ends)
    in_use, whole = zero_buffers(costs, req, c, list(layer_costs) or None)
    return ilp.StageProblem(costs.num_blocks, options, embed, head, c.pp, c.pp * c.v, *weights,
                            p2p, memory_limit, parts.alpha, parts.slope,
                            phi, needs_tp=c.tp > 1, tie_s=tie_time(costs, req, c), runs=runs,
                            stage_s=actions_per_microbatch(c.schedule) *
                            (cluster.action_floor + cluster.action_overhead),
                            hide_alpha_s=parts.hide_alpha, hide_s_per_byte=parts.hide_slope,
                            hide_beside=(1 - cluster.comm_sm_share) * parts.beside,
                            hide_least=max(cluster.comm_sm_share, 1 / units),
                            rank_temp=temp, lazy_grads=lazy, split_w=c.schedule == "zb-h1",
                            zero_in_use=in_use,
                            zero_whole=whole, step_share=_step_share(costs, cluster, c),
                            moments=inflight_moments(c.schedule, c.pp, c.microbatches, c.v,
                                                     records(req, c)))


def _step_share(costs: ModelCosts, cluster, c: Candidate) -> float:
    """The optimizer step's fp32 gradient copies per static byte (ModelCosts.step_share) where
    the runtime makes them: fxpar's (runtime.training.main_weights). Megatron keeps fp32 main
    gradients instead and FSDP2 fp32 sharded weights, which their profiles' memory does not
    count apart."""
    return costs.step_share(zero_axis.sharding_of(c)) if cluster.runtime in ("", "fxpar") else 0.0


def memory_terms(c: Candidate, inflight, layer_costs, ends) -> tuple[tuple, tuple]:
    """(X_r, lazy_r) per pipeline rank (planner.search.ilp, "Memory"). X_r: the largest
    temporary (LayerCost.temp_bytes) of any block option, or of the embedding on the first
    rank and the loss's head on the last. lazy_r: the rank runs every forward before its first
    backward (it holds all m·v of its activation sets at once), so the gradients autograd
    makes in the backward (`lazy_grad_bytes`) are not there at its activation peak."""
    blocks = max((b.temp_bytes for b in layer_costs), default=0.0)
    embed, head = (e.temp_bytes if e is not None else 0.0 for e in ends)
    first, last = 0, (c.pp * c.v - 1) % c.pp
    temp = tuple(max(blocks, embed if r == first else 0.0, head if r == last else 0.0)
                 for r in range(c.pp))
    return temp, tuple(f >= c.microbatches * c.v for f in inflight)


def _tied_local(costs: ModelCosts, req: Request, c: Candidate) -> float:
    """The parameters the embedding and the head share, as one rank holds them (a part of the
    vocabulary under a vocabulary-parallel tp)."""
    if not costs.tied_end_params:
        return 0.0
    shard = c.tp if costs.vocab_parallel(c.tp, c.micro_batch, req.cluster, c.cp) else 1
    return costs.tied_end_params / shard


def _keeps_tied_whole(req: Request) -> bool:
    """fxpar's runtime keeps tied weights whole under every ZeRO level (runtime.data_parallel.
    sharded_dp); FSDP and Megatron's distributed optimizer shard them with the rest."""
    return req.cluster.runtime in ("", "fxpar")


def _untied(costs: ModelCosts, req: Request, c: Candidate, head, tied: float):
    """The head's terms without the `tied` weights it shares with the embedding when one stage
    holds both: one tensor, held once (on different stages each holds a copy,
    runtime.training.tied)."""
    if c.pp * c.v > 1 or not tied or head.static_bytes == 0:
        return head
    sharding = zero_axis.sharding_of(c)
    static = tied * (costs.whole_rate(sharding) if _keeps_tied_whole(req)  # as end_layer
                     else sum(costs.static_per_param(sharding)))
    grads = head.grad_bytes - tied * costs.training.grad_bytes
    return replace(head, static_bytes=head.static_bytes - static, grad_bytes=grads,
                   lazy_grad_bytes=min(head.lazy_grad_bytes, grads))


def actions_per_microbatch(schedule: str) -> int:
    """Compute actions of one stage per micro-batch: F and B, or F, I and W."""
    return 3 if schedule == "zb-h1" else 2


def runtime_terms(option, cost, req: Request, c: Candidate, costs: ModelCosts):
    """An ILP option (ilp.BlockOption or EndLayer) with the runtime's own costs on this cluster:
    ZB-H1's second backward traversal (I and W each walk the graph: as calibration measured it
    where it measured the runtime, else from the layer's flops, LayerCost.retraverse_share; the
    first stage, whose I has nothing to do, is priced alike), the optimizer step over the
    share of the parameters' states the rank holds (0 in the presets) and the gradients the
    runtime leaves to autograd to make (`lazy_grads`)."""
    if cost is None:
        return option
    cluster = req.cluster
    share = cluster.split_backward if cluster.runtime_priced else cost.retraverse_share
    split = cost.bwd_s * share if c.schedule == "zb-h1" and not records(req, c) else 0.0
    share = zero_axis.sharding_of(c).fractions()[2]
    return replace(option, time_s=option.time_s + split, step_s=cost.optimizer_s(cluster) * share,
                   lazy_grad_bytes=lazy_grads(costs, req, c, option, cost),
                   record_bytes=cost.record_bytes if records(req, c) else 0.0)


def records(req: Request, c: Candidate) -> bool:
    """Whether ZB-H1's I records the gradients W starts from (split_backward "record",
    runtime.pipeline.split_backward): W then runs only the weights' halves, and the recorded
    gradients live from I until W."""
    return c.schedule == "zb-h1" and c.split_backward == "record"


def lazy_grads(costs: ModelCosts, req: Request, c: Candidate, option, cost) -> float:
    """Gradient bytes of an option that no buffer holds between backwards, as fxpar's runtime
    keeps them (runtime.training.trainer; other runtimes are taken to hold them all, as
    Megatron's contiguous gradient buffer does): with no replica to sum with and no sharding,
    every gradient (the step frees them, autograd makes them again); else the expert weights'
    when no other rank holds the same experts (their gradients are not bucketed)."""
    if req.cluster.runtime not in ("", "fxpar"):
        return 0.0
    if c.dp * c.cp == 1 and c.zero == 0:
        return option.grad_bytes
    if costs.ep_pricing is None or c.dp * c.cp > costs.ep:
        return 0.0
    experts = costs.ep_pricing.expert_params(costs.kind_of(cost.layer, -1))
    return experts * costs.training.grad_bytes


def tensor_limit(costs: ModelCosts, req: Request, c: Candidate, limit: float) -> float:
    """What live tensors may take of a device limit: less the CUDA context, workspaces and
    NCCL buffers of the candidate's process groups, and the allocator's reserve
    (cost_model.hardware.device_memory)."""
    return device_memory(req.cluster).usable(limit, groups_of(c.dp, c.tp, c.pp, c.cp, costs.ep))


def device_bytes(costs: ModelCosts, req: Request, c: Candidate, tensor_peak: float) -> float:
    """A predicted tensor peak as the device memory it takes (`tensor_limit`'s inverse)."""
    return device_memory(req.cluster).device_bytes(tensor_peak,
                                                   groups_of(c.dp, c.tp, c.pp, c.cp, costs.ep))


def zero_buffers(costs: ModelCosts, req: Request, c: Candidate, blocks=None
                 ) -> tuple[float, float]:
    """Whole-sized buffers of one or two layers that ZeRO levels 2-3 hold for a moment
    (cost_model.layers.sharding.peak_buffers: the unit in use, and the whole transient), for
    the largest layers the candidate may have (`blocks`: LayerCosts, else every block option
    of the request)."""
    if c.zero < 2:
        return 0.0, 0.0
    blocks = blocks if blocks is not None else block_costs(costs, req, c.tp, c.micro_batch, c.cp)
    layers = _block_units(costs, blocks)
    layers += [cost.params for cost in costs.end_costs(c.micro_batch, req.cluster, cp=c.cp,
                                                       tp=c.tp)]
    t = costs.training
    return peak_buffers(layers, t.weight_bytes, t.grad_bytes, zero_axis.sharding_of(c),
                        max(cost.act_bytes for cost in blocks))


def _block_units(costs: ModelCosts, blocks) -> list[int]:
    """The blocks' units as the model has them, whichever options price them: each kind's
    largest option (a block run whole where a tensor-parallel option cuts it), as many times as
    the model holds blocks of the kind, two at most (the unit in use and the prefetched one).
    Counting options instead gave a plan whose search had two options per kind another peak
    than the same plan searched with one."""
    largest: dict = {}
    for cost in blocks:
        kind = costs.kind_of(cost.layer, cost.layer)
        largest[kind] = max(largest.get(kind, 0), cost.params)
    held = dict.fromkeys(largest, 0)
    for kind, n in costs.runs:
        held[kind] = held.get(kind, 0) + n
    return [params for kind, params in largest.items() for _ in range(min(2, held[kind] or 1))]


def tie_time(costs: ModelCosts, req: Request, c: Candidate) -> float:
    """τ of the ILP: the all-reduce summing the gradients of weights the embedding and the head
    share over the first and the last pipeline rank, after the data-parallel sum (exposed)."""
    if c.pp == 1 or not costs.tied_end_params:
        return 0.0
    shard = c.tp if costs.vocab_parallel(c.tp, c.micro_batch, req.cluster, c.cp) else 1
    nbytes = costs.tied_end_params * costs.training.grad_bytes / shard
    return collective_time(req.cluster, "all_reduce", nbytes, 2,
                           stride=(c.pp - 1) * c.tp * c.cp * c.dp)


def comm_terms(costs, req, c: Candidate) -> tuple[float, SyncParts, int]:
    """(p2p seconds per stage boundary and micro-batch, forward + backward; the data-parallel
    collectives of a rank (cost_model.layers.sharding.SyncParts); the layers a rank holds, for
    the share of them nothing hides). Ranks are laid out tp innermost, then cp, dp, pp: a
    pipeline neighbour is tp·cp·dp ranks away; gradients are averaged over the dp·cp ranks that
    hold the same weights, tp ranks apart. Where collectives have no stream of their own
    (Cluster.comm_stream false: CPU ranks) the measured share dp_overlap of the hideable part is
    hidden, and the rest exposed."""
    return (p2p_time(costs, req, c), *sync_parts(costs, req, c))


def p2p_time(costs, req, c: Candidate) -> float:
    if c.pp == 1:
        return 0.0
    tp, cp, dp = c.tp, c.cp, c.dp
    boundary = costs.boundary_bytes(c.micro_batch) / cp
    return 2 * collective_time(req.cluster, "p2p", boundary, 2, stride=tp * cp * dp)


def sync_parts(costs, req, c: Candidate) -> tuple[SyncParts, int]:
    """(the data-parallel collectives of a rank, the layers it holds): `comm_terms`."""
    tp, cp, dp = c.tp, c.cp, c.dp
    units = -(-(costs.num_blocks + len(costs.ends)) // c.pp)
    if c.zero or c.dp_shard:  # sharded data parallel: reduce-scatters and all-gathers
        t = costs.training
        parts = zero_axis.comm_terms(req.cluster, c, zero_axis.sharding_of(c),
                                     t.weight_bytes / t.grad_bytes, units)
    else:
        group = dp * cp
        alpha = collective_time(req.cluster, "all_reduce", 0.0, group, stride=tp)
        slope = (collective_time(req.cluster, "all_reduce", 2.0**30, group, stride=tp)
                 - alpha) / 2**30
        parts = SyncParts(0.0, 0.0, alpha, slope, BACKWARD_SHARE)
    if not req.cluster.comm_stream:
        parts = SyncParts(*parts.discounted(req.cluster.dp_overlap))
    return parts, units


def least_sync(parts: SyncParts, units: int, grads: float, cluster: Cluster) -> float:
    """The least exposed seconds of a rank's data-parallel collectives for `grads` gradient
    bytes: the exposed part and the least share of the hideable one (ilp._sync_time)."""
    hideable = parts.hide_alpha + parts.hide_slope * grads
    return parts.alpha + parts.slope * grads + max(cluster.comm_sm_share, 1 / units) * hideable
