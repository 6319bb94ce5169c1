"""Price one layer under one strategy, from its graph.

`profile_layer` cuts the layer out of the captured graph, applies the tensor-parallel rewrite when
asked, re-propagates fake shapes and counts every node (cost_model.ops.node_cost). `price` turns a profile into
times and bytes for a micro-batch size and a strategy:

  activations  saved-for-backward bytes, deduplicated by tensor (Korthikanti et al. 2022 count per
               GPT layer: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) under tensor parallelism).
               Sequence parallel divides the tensors the TP rewrite left replicated (the layer
               input, the norms' inputs and outputs, the dropout masks after each row-parallel
               reduce: 10sbh) by t; selective recompute drops the attention core (the scores and
               everything computed from them up to the attention-over-values matmul: softmax
               output, dropout mask and dropout output, 5as²b); full recompute keeps only the
               layer input. Under the runtime's autocast, what autocast saves instead
               (cost_model.layers.autocast_saved: measured on fake tensors, with the 16-bit
               casts of the weights per micro-batch).
  compute      Σ roofline(op) forward and backward; recompute adds the recomputed forward.
  comm         the collectives the rewrite inserted, priced by alpha-beta ring models: those of
               the tensor-parallel rewrite, and for tp+sp those of the real sequence-parallel
               rewrite (the gradient sums of replicated norm weights, the re-gather of each
               column-parallel block's input in backward). Recomputation runs the forward
               collectives of its region again in backward (`_rerun_modes`); repeated bytes
               are reported apart from the bytes sent once.
The ends ("embed", "head") under tp are profiled vocabulary-parallel, padded when tp does not
divide the vocabulary, as passes.stages.program rewrites them.
Everything but a parameter's gradient sum is linear in the micro-batch size, so profiles are
taken once at the captured batch.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from cost_model.ops import moe
from cost_model.ops import graph_facts as op_graph
from cost_model.hardware.cluster import Cluster
from cost_model.hardware.comm import bytes_on_wire, collective_time
from cost_model.hardware.compute import kernels_s, op_seconds
from cost_model.ops.node_cost import UnknownOpError, node_cost, saved_node_name
from cost_model.ops.ring_attention import RingShape
from cost_model.layers.graph_saves import autocast_share, core_nodes, joins, saved, weighted
from cost_model.layers.fusion import fused_bytes
from cost_model.layers.runtime_terms import launched, tp_exposed
from cost_model.layers.ring_pricing import fused_attention_s, ring_compute_s, ring_exposed
from cost_model.layers.strategy import Strategy
from passes.capture.trace import Captured, Layer, propagate_shapes
from passes.rewrite.context_parallel import ContextParallelError, find_attentions
from passes.rewrite.expert_parallel import moe_nodes
from passes.stages.pipeline_split import split_stage
from passes.rewrite.recompute import attention_cores
from passes.rewrite.sequence_parallel import sequence_parallel, with_params
from passes.rewrite.sharding import LAYER, ShardingError, localize_shapes
from passes.rewrite.tensor_parallel import tensor_parallel
from passes.rewrite.vocab_parallel import vocab_parallel, vocab_parallel_cross_entropy
from runtime.comm import collectives as C


_bytes = op_graph.total_bytes  # of a tensor, or of the tensors in nested tuples and lists


@dataclass(frozen=True)
class OpRecord:
    op_class: str
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    matmul_flops: float
    core: bool                     # part of the attention core (see core_nodes)
    pairs: float = 0.0             # fused attention's (batch x head) pairs
    per_element: str = ""          # OpCost.per_element: priced per element when measured
    elements: float = 0.0
    ringed: bool = False           # replaced by ring attention under context parallelism
    gemm: tuple = ()               # OpCost.gemm: a matmul's (m, n, k, groups), m per batch
    # a pointwise op's forward bytes when pointwise chains run fused (cost_model.layers.fusion);
    # None: not a pointwise op
    fused_bytes: float | None = None
    weighted: bool = False         # a matmul with a parameter operand: its backward has a dW half


@dataclass(frozen=True)
class Collective:
    """One communication a collective node makes in one pass."""

    kind: str                      # "all_reduce", ...
    phase: str                     # "fwd" | "bwd"
    nbytes: float                  # full tensor size at the captured batch
    per_sample: bool = True        # False for a parameter's gradient sum: batch-independent
    repeated: bool = False         # communication redone to save memory (sp re-gather)
    rerun: frozenset = frozenset()  # recompute modes ("full", "selective") that run it again


@dataclass(frozen=True)
class LayerProfile:
    layer: str
    kind: str
    tp: int
    batch: int                     # captured batch size; everything below is at this size
    ops: tuple[OpRecord, ...]
    saved: float                   # saved-for-backward bytes
    saved_core: float              # of which attention core
    saved_replicated: float        # of which outside the tensor-parallel regions (tp > 1)
    input_bytes: float             # floating inputs of the layer (what full recompute keeps)
    output_bytes: float            # what the layer hands to the next one
    params: int                    # parameters held per device
    collectives: tuple[Collective, ...] = field(default=())
    kv_bytes: float = 0.0          # keys + values entering fused attention (what a CP ring moves)
    kv_grad_bytes: float = 0.0     # their fp32 gradient accumulators (the backward ring's load)
    rings: tuple[RingShape, ...] = ()  # the attentions ring attention would replace
    # Statistics of mixture-of-experts balance losses, summed over the cp group forward and
    # backward (cost_model.ops.moe.balance_bytes): per rank whatever cp is
    balance_bytes: float = 0.0
    # Under tp+sp, from the sequence-parallel rewrite; None when it does not apply (tp == 1, an
    # end layer, or a ShardingError) and Megatron's swap of each all-reduce is priced instead.
    sp_collectives: tuple[Collective, ...] | None = None
    sp_error: str | None = None    # why that rewrite does not apply (the op it stops at)
    tensors: int = 0               # parameter tensors (the optimizer step's per-tensor cost)
    largest_bytes: float = 0.0     # the largest tensor one op of the layer makes
    loss_bytes: float = 0.0        # the logits a cross-entropy of the layer reads (0: none)
    join_bytes: float = 0.0        # outputs of the ops where a weight meets the input (`joins`)
    # under autocast, the 16-bit casts of the weights its matmuls save: per micro-batch, whatever
    # its size (cost_model.layers.autocast_saved)
    cast_bytes: float = 0.0


@dataclass(frozen=True)
class LayerCost:
    """A layer under a strategy for one micro-batch of `micro_batch` samples, on one device."""

    layer: str
    strategy: Strategy
    micro_batch: int
    fwd_s: float                   # forward compute + tensor-parallel communication
    bwd_s: float                   # backward (+ recompute) compute + communication
    comm_s: float                  # the communication part of fwd_s + bwd_s
    flops: float                   # executed, recompute included
    model_flops: float             # forward + backward without recompute
    act_bytes: float               # kept for backward, per micro-batch
    params: int
    comm_bytes: tuple[tuple[str, float], ...]   # (kind, bytes sent per rank), once per pass
    # (kind, bytes sent per rank) again to save memory: recomputed forward collectives and the
    # sequence-parallel re-gather in backward (runtime.comm.instrument counts them apart too)
    repeated_bytes: tuple[tuple[str, float], ...] = ()
    tensors: int = 0               # parameter tensors
    # ZB-H1's split as the executor runs it by default (runtime.pipeline.executor): W is a
    # backward from the outputs again, all of B, and I is B but the weight gradients, so
    # I + W = (1 + this) x B, this = 1 - dW / B by flops
    retraverse_share: float = 0.0
    # What the layer's pass holds for a moment beyond act_bytes (`_temporary`): two of its
    # largest tensor, and under recomputation the activations the backward recomputes
    temp_bytes: float = 0.0
    # ZB-H1 with split_backward="record" (runtime.pipeline.split_backward): the gradients I
    # records at each join for W, per micro-batch; 0 under recomputation (never recorded there)
    record_bytes: float = 0.0

    def optimizer_s(self, cluster) -> float:
        """The optimizer step over this layer's parameters on one device (cluster's terms)."""
        per_param = cluster.optimizer_per_param + \
            cluster.optimizer_bytes / (cluster.mem_bw * cluster.bw_eff)
        return self.params * per_param + self.tensors * cluster.optimizer_per_tensor


def _extract(captured: Captured, layer: Layer) -> fx.GraphModule:
    """The layer alone as a graph whose placeholders are its inputs (meta shapes kept): a
    three-stage split into the layers before it, the layer, and the layers after it. By layer
    index, not graph position: exported graphs list every parameter's get_attr first."""
    index = {l.name: l.index for l in captured.layers}
    node_stage = {node: (index[owner] > layer.index) * 2 if owner != layer.name else 1
                  for node, owner in captured.layer_of().items()}
    return split_stage(captured.gm, node_stage, 3, 1).gm


def _fake_inputs(sub: fx.GraphModule) -> list[torch.Tensor]:
    inputs = []
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            inputs.append(torch.empty(val.shape, dtype=val.dtype, device="meta"))
    return inputs


def profile_layer(captured: Captured, layer: Layer, tp: int = 1,
                  autocast: torch.dtype | None = None) -> LayerProfile:
    """The layer as one rank runs it at tensor-parallel size tp (raises ShardingError when the
    rewrite does not divide it); under `autocast` (the runtime's precision "bf16"/"fp16": 16-bit
    matmuls over the captured fp32 weights) with the bytes autocast saves for backward."""
    sub = _extract(captured, layer)
    inputs = _fake_inputs(sub)
    share, casts = autocast_share(sub, inputs, autocast) if autocast is not None else (1.0, 0.0)
    replicated_names, sp, sp_error = None, None, None
    if tp > 1:
        base_saved = saved(sub)
        _shard_whole(sub, layer, tp)
        propagate_shapes(sub, inputs)
        # A tensor the rewrite did not shrink is held whole on every rank: sequence parallel is
        # what shards it.
        replicated_names = {k for k, v in saved(sub).items() if base_saved.get(k) == v}
        if layer.kind == "block":
            sp, sp_error = _sp_collectives(captured, layer, tp)
    else:
        propagate_shapes(sub, inputs)
    profile = _profile(sub, layer, tp, replicated_names, captured.batch, captured.seq)
    return dataclasses.replace(profile, sp_collectives=sp, sp_error=sp_error,
                               saved=profile.saved * share, saved_core=profile.saved_core * share,
                               saved_replicated=profile.saved_replicated * share,
                               cast_bytes=casts / tp)


def check_tensor_parallel(captured: Captured, layer: Layer, tp: int) -> None:
    """Raises ShardingError where the layer's tensor-parallel rewrite at tp fails on this
    capture (ModelCosts.capture_wide: the same model at another batch)."""
    _shard_whole(_extract(captured, layer), layer, tp)


def _shard_whole(sub: fx.GraphModule, layer: Layer, tp: int) -> None:
    """`_shard` of the layer's extracted graph, every node of it the layer's."""
    _shard(sub, layer, {layer.name: [n.name for n in sub.graph.nodes]}, tp)


def _shard(sub: fx.GraphModule, layer: Layer, layers: dict, tp: int, localize: bool = True):
    """The rewrite passes.stages.program applies at tp: the ends vocabulary-parallel (padded when tp
    does not divide the vocabulary: the planner prices the padding it will ask for), the
    blocks column/row-parallel."""
    if layer.kind == "block":
        tensor_parallel(sub, layers, tp, 0, localize=localize)
    else:
        vocab_parallel(sub, layers, tp, 0, pad=True, localize=localize)


_OUTSIDE = "<outside>"  # tag of the stand-ins for the neighbouring layers


def _sp_collectives(captured: Captured, layer: Layer, tp: int
                    ) -> tuple[tuple[Collective, ...] | None, str | None]:
    """The layer's collectives under tp+sp, read off the real sequence-parallel rewrite of a
    fresh copy (or None, and the rewrite's reason). Its inputs come through stand-ins for a
    layer that is not sequence parallel (as the first block's come from the embedding), so the
    rewrite shards them there; that resharding, like the gather before the output, belongs to
    the neighbour, as at run time."""
    sub = _extract(captured, layer)
    layers = {layer.name: _stand_in_neighbours(sub)}
    try:
        tensor_parallel(sub, layers, tp, 0, localize=False)
        sequence_parallel(sub, layers, {layer.name}, tp, localize=False)
        localize_shapes(sub)  # a rewrite that does not run on its shapes: no sp either
    except ShardingError as err:
        return None, str(err)
    return _collectives(sub, layer.name), None


def _stand_in_neighbours(sub: fx.GraphModule) -> list[str]:
    """Route each floating input through a node tagged _OUTSIDE and tag the output _OUTSIDE;
    returns the names of the layer's own nodes."""
    graph = sub.graph
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and ph.users:
            with graph.inserting_after(ph):
                stand_in = graph.call_function(torch.clone, (ph,))
            ph.replace_all_uses_with(stand_in, delete_user_cb=lambda user: user is not stand_in)
            stand_in.meta = {**ph.meta, LAYER: _OUTSIDE}
    next(n for n in graph.nodes if n.op == "output").meta[LAYER] = _OUTSIDE
    graph.lint()
    sub.recompile()
    return [n.name for n in graph.nodes if n.meta.get(LAYER) != _OUTSIDE]


def _profile(sub: fx.GraphModule, layer: Layer, tp: int, replicated: set[str] | None,
             batch: int, seq: int):
    modules = dict(sub.named_modules())
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    core = core_nodes(sub, seq)
    ring = _ring_load(sub, layer, seq)
    # what the context-parallel rewrite replaces by ring attention: the attention's output node
    # (a fused SDPA or the attention-over-values matmul) and the score ops before it
    outputs = ring.pop("outputs")
    ringed = core | outputs if ring["rings"] else set()
    costs = {node: node_cost(node, modules) for node in sub.graph.nodes
             if node.target not in _MOVES}
    fused = fused_bytes(sub, {node.name: cost.op_class for node, cost in costs.items()})
    ops = [OpRecord(cost.op_class, cost.fwd_flops, cost.bwd_flops, cost.fwd_bytes,
                    cost.bwd_bytes, cost.matmul_flops, node.name in core, cost.pairs,
                    cost.per_element, cost.elements, node.name in ringed, cost.gemm,
                    fused.get(node.name), cost.op_class == "matmul" and weighted(node, modules))
           for node, cost in costs.items()]
    ops += [_moe_movement(node) for node in moe_nodes(sub)]
    kept = saved(sub)
    out = next(n for n in sub.graph.nodes if n.op == "output")
    return LayerProfile(
        layer.name, layer.kind, tp, batch, tuple(ops),
        saved=sum(kept.values()),
        saved_core=sum(b for k, b in kept.items() if saved_node_name(k) in core),
        saved_replicated=sum(b for k, b in kept.items() if replicated and k in replicated),
        input_bytes=sum(_bytes(p.meta["val"]) for p in placeholders
                        if p.meta["val"].dtype.is_floating_point),
        output_bytes=_bytes(fx.node.map_arg(out.args[0], lambda n: n.meta.get("val"))),
        params=sum(p.numel() for p in sub.parameters()),
        tensors=sum(1 for _ in sub.parameters()),
        collectives=_collectives(sub, layer.name), **ring,
        balance_bytes=sum(moe.balance_bytes(n) for n in moe_nodes(sub)),
        largest_bytes=max([_bytes(n.meta.get("val")) for n in sub.graph.nodes
                           if n.op.startswith("call")]
                          + [moe.routed_bytes(n) for n in moe_nodes(sub)]
                          + [_vocab_loss_bytes(n) for n in sub.graph.nodes], default=0.0),
        loss_bytes=max((_bytes(n.args[0].meta.get("val")) for n, c in costs.items()
                        if c.op_class == "loss" and n.args and isinstance(n.args[0], fx.Node)
                        and n.target is not vocab_parallel_cross_entropy), default=0.0),
        join_bytes=sum(_bytes(n.meta.get("val")) for n in joins(sub, modules)))


def _vocab_loss_bytes(node: fx.Node) -> float:
    """The fp32 copy of its logits slice that a vocabulary-parallel loss makes (and the exp of
    it beside), whatever the logits' dtype; it is not a fused kernel (loss_bytes leaves it out),
    so the two are its moment's temporaries (`_temporary`)."""
    if node.target is not vocab_parallel_cross_entropy:
        return 0.0
    logits = node.args[0].meta.get("val")
    return logits.numel() * max(4, logits.element_size())


def _moe_movement(node: fx.Node) -> OpRecord:
    """A MoE layer's routed rows moved through memory around its GEMMs (moe.movement_bytes)."""
    fwd, bwd = moe.movement_bytes(node)
    return OpRecord("elementwise", 0.0, 0.0, fwd, bwd, 0.0, False)


# What each collective of runtime.comm.collectives sends: (forward kind, backward kind), None where
# that pass does not communicate. The functions' `_fxpar_collective` names one pass only.
_MOVES = {
    C.tp_copy: (None, "all_reduce"),
    C.tp_all_reduce: ("all_reduce", None),
    C.tp_grad_sum: (None, "all_reduce"),
    C.tp_sum: ("all_reduce", "all_reduce"),
    C.tp_grad_share: (None, None),
    C.sp_all_gather: ("all_gather", "reduce_scatter"),
    C.sp_reduce_scatter: ("reduce_scatter", "all_gather"),
    C.sp_scatter: (None, "all_gather"),
    C.sp_gather: ("all_gather", None),
    C.tp_gather: ("all_gather", None),   # a modulation's [b, k·h] output (passes.rewrite.tp_gather)
    C.sp_gather_linear: ("all_gather", "reduce_scatter"),  # + the re-gather in backward
    C.whole_sequence: ("all_gather", None),
}


def _collectives(gm: fx.GraphModule, tag: str) -> tuple[Collective, ...]:
    """Every communication of the nodes of layer `tag`, in graph order."""
    nodes = [n for n in gm.graph.nodes if n.meta.get(LAYER) == tag]
    reruns = _rerun_modes(gm, nodes)
    found: list[Collective] = []
    for node in nodes:
        if node.target is vocab_parallel_cross_entropy:
            found += _loss_collectives(node)
        if node.target not in _MOVES:
            if hasattr(node.target, "_fxpar_collective"):
                raise ValueError(f"{node.name}: collective {node.target.__name__} has no price")
            continue
        (fwd, bwd), nbytes = _MOVES[node.target], _moved_bytes(node)
        # A replicated parameter's gradient sum moves the parameter, whatever the batch.
        per_sample = op_graph.kind(node.args[0]) == "activation"
        if fwd:
            found.append(Collective(fwd, "fwd", nbytes, per_sample, rerun=reruns[node]))
        if bwd:
            found.append(Collective(bwd, "bwd", nbytes, per_sample))
        if node.target is C.sp_gather_linear:  # keeps the local slice, gathers it again
            found.append(Collective("all_gather", "bwd", nbytes, per_sample, repeated=True))
    return tuple(found)


def _moved_bytes(node: fx.Node) -> float:
    """The full buffer a ring moves: the larger of input and output (a gather grows its input,
    a reduce-scatter shrinks it); the fused gather-linear's is its input times the parts."""
    if node.target is C.sp_gather_linear:
        return _bytes(node.args[0].meta.get("val")) * node.args[5]
    return max(_bytes(node.args[0].meta.get("val")), _bytes(node.meta.get("val")))


def _loss_collectives(node: fx.Node) -> list[Collective]:
    """vocab_parallel_cross_entropy all-reduces three fp32 values per row in forward (the row
    maximum, the sum of exponentials, the target's logit) and nothing in backward."""
    rows = node.args[1].meta["val"].numel()
    return [Collective("all_reduce", "fwd", 4.0 * rows)] * 3


def _rerun_modes(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, frozenset]:
    """Per node, the recompute modes that run it again in backward, regions as passes.rewrite.recompute
    cuts them: the whole layer (full), each attention core (selective)."""
    modules = dict(gm.named_modules())
    body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    modes: dict[fx.Node, set] = defaultdict(set)
    for region, mode in [(body, "full")] + [(c, "selective") for c in attention_cores(gm, nodes)]:
        # Non-reentrant checkpointing stops recomputing once the region's last saved tensor is
        # back (torch's early stop): what comes after the last node that saves is not rerun.
        last = max((i for i, n in enumerate(region) if _saves(n, modules)), default=-1)
        for n in region[:last + 1]:
            modes[n].add(mode)
    return defaultdict(frozenset, {n: frozenset(m) for n, m in modes.items()})


def _saves(node: fx.Node, modules) -> bool:
    """Whether autograd keeps a tensor for the node's backward."""
    if node.target in (C.sp_gather_linear, with_params):  # local input and weights; module's own
        return True
    if node.target in _MOVES:
        return False
    try:
        return bool(node_cost(node, modules).saved)
    except UnknownOpError:
        return True  # unknown: assume it keeps something, so the collectives before it rerun


def price(profile: LayerProfile, strategy: Strategy, micro_batch: int, cluster: Cluster,
          tp: int = 1, cp: int = 1) -> LayerCost:
    """Times and bytes of the profiled layer for a micro-batch; tp and cp are the group sizes of
    the mesh. Context parallelism gives each rank 1/cp of the tokens — zig-zag sharding balances
    causal attention too — and adds the key/value ring (cost_model.layers.ring_pricing) and the
    all-reduce of any mixture-of-experts balance statistics (`_balance`)."""
    scale = micro_batch / profile.batch / cp
    ops, ring_fwd, ring_bwd = profile.ops, 0.0, 0.0
    # On a cluster whose runtime is measured (CPU profiles), the attentions run as the ring's
    # block loops, priced op by op; presets keep the fused kernel's price, which no device run
    # has checked against the ring yet
    as_run = cp > 1 and bool(profile.rings) and cluster.runtime_priced
    if as_run:
        ops = [op for op in ops if not op.ringed]
        ring_fwd, ring_bwd = ring_compute_s(profile, micro_batch, cp, cluster)
    # every op of the layer's graph also costs the runtime's time per op and pass, whatever
    # the batch (cluster.op_overhead: measured on a training run, 0 in the presets)
    ops_s = len(ops) * cluster.op_overhead
    fwd_ops = [op_seconds(op, scale, cluster, backward=False) for op in ops]
    bwd_ops = [op_seconds(op, scale, cluster, backward=True) for op in ops]
    fwd = ops_s + ring_fwd + launched(fwd_ops, cluster)
    bwd = ops_s + ring_bwd + launched(bwd_ops, cluster)
    fwd_flops = sum(op.fwd_flops for op in profile.ops) * scale
    model_flops = fwd_flops + sum(op.bwd_flops for op in profile.ops) * scale
    recompute_s, recompute_flops = _recompute(profile, strategy, scale, cluster, fwd, fwd_flops,
                                              ring_fwd)
    fwd_comm, bwd_comm, comm_bytes, repeated = _comm(profile, strategy, scale, cluster, tp)
    gemm = [sum(t for op, t in zip(ops, times) if op.op_class == "matmul")
            for times in (fwd_ops, bwd_ops)]
    fwd_comm, bwd_comm = tp_exposed(cluster, tp, (fwd_comm, bwd_comm), gemm)
    if cp > 1 and profile.kv_bytes:  # a layer without attention sends nothing round a ring
        hidden = (ring_fwd, ring_bwd) if as_run else fused_attention_s(profile, scale, cluster)
        ring = ring_exposed(profile, scale, cluster, tp, cp, *hidden)
        # and each ring step costs what calibration measured beyond the ops and the messages
        steps = cp * len(profile.rings)
        fwd_ring = ring.fwd_s + steps * cluster.ring_step_fwd
        fwd_comm += fwd_ring
        bwd_comm += ring.bwd_s + steps * cluster.ring_step_bwd
        comm_bytes = tuple(sorted(comm_bytes + (("p2p", ring.sent),)))
        if strategy.recompute != "none":  # recomputing the attention runs its forward ring again
            bwd_comm += fwd_ring
            repeated = tuple(sorted(repeated + (("p2p", ring.fwd_sent),)))
    if cp > 1 and profile.balance_bytes:
        seconds, wire = _balance(profile, micro_batch, cluster, tp, cp)
        fwd_comm, bwd_comm = fwd_comm + seconds, bwd_comm + seconds
        comm_bytes = _plus(comm_bytes, "all_reduce", 2 * wire)
        if strategy.recompute == "full":  # the recomputed forward sums them again
            bwd_comm += seconds
            repeated = _plus(repeated, "all_reduce", wire)
    return LayerCost(profile.layer, strategy, micro_batch,
                     fwd_s=fwd + fwd_comm, bwd_s=bwd + recompute_s + bwd_comm,
                     comm_s=fwd_comm + bwd_comm,
                     flops=model_flops + recompute_flops, model_flops=model_flops,
                     act_bytes=_activations(profile, strategy, tp) * scale
                     + (profile.cast_bytes if strategy.recompute != "full" else 0.0),
                     params=profile.params, comm_bytes=comm_bytes, repeated_bytes=repeated,
                     tensors=profile.tensors,
                     retraverse_share=_retraverse_share(profile, scale, model_flops - fwd_flops
                                                        + recompute_flops),
                     temp_bytes=_temporary(profile, strategy, tp, cluster.fused_loss) * scale,
                     record_bytes=profile.join_bytes * scale if strategy.recompute == "none"
                     else 0.0)


def _ring_load(sub: fx.GraphModule, layer: Layer, seq: int) -> dict:
    """kv_bytes and kv_grad_bytes: the keys and values ring attention would pass around (as
    passes.rewrite.context_parallel finds them: fused or written out, GQA blocks unrepeated), and their
    fp32 gradient accumulators; rings: the shapes ring attention would take; outputs: the
    attentions' output nodes. Zero and empty when the layer cannot run context-parallel."""
    try:
        every = {layer.name: [n.name for n in sub.graph.nodes]}
        found = [a for a, _ in find_attentions(sub, every, seq)]
    except ContextParallelError:
        found = []
    kv = [x.meta["val"] for a in found for x in (a.k, a.v)]
    return {"kv_bytes": float(sum(_bytes(t) for t in kv)),
            "kv_grad_bytes": float(sum(t.numel() * 4 for t in kv)),
            "rings": tuple(RingShape.of(a.q.meta["val"], a.k.meta["val"], a.causal,
                                        a.mask.meta["val"] if a.mask is not None else None)
                           for a in found),
            "outputs": {a.output.name for a in found}}


def _balance(profile: LayerProfile, micro_batch: int, cluster: Cluster, tp: int,
             cp: int) -> tuple[float, float]:
    """(seconds, bytes sent) of one all-reduce of the layer's balance statistics over the cp
    group (forward; backward sums their gradient the same way). They are per sequence, so
    their size follows the micro-batch, not the rank's share of the tokens."""
    nbytes = profile.balance_bytes * micro_batch / profile.batch
    return (collective_time(cluster, "all_reduce", nbytes, cp, stride=tp),
            bytes_on_wire("all_reduce", nbytes, cp))


def _plus(pairs: tuple, kind: str, nbytes: float) -> tuple:
    merged = dict(pairs)
    merged[kind] = merged.get(kind, 0.0) + nbytes
    return tuple(sorted(merged.items()))


def _retraverse_share(profile: LayerProfile, scale: float, backward_flops: float) -> float:
    """1 - dW / B by flops (LayerCost.retraverse_share): B the backward, recompute included; dW
    the weight gradients, one product as large as the forward's per matmul with a parameter
    operand (attention's products of activations have no weight half)."""
    if backward_flops <= 0:
        return 0.0
    weights = sum(op.matmul_flops for op in profile.ops if op.weighted)
    return max(0.0, 1.0 - weights * scale / backward_flops)


def _recompute(profile, strategy, scale, cluster, fwd_s, fwd_flops, ring_fwd):
    if strategy.recompute == "full":
        return fwd_s, fwd_flops
    if strategy.recompute == "selective" and ring_fwd:  # the core is the ring attention
        return ring_fwd, sum(op.fwd_flops for op in profile.ops if op.ringed) * scale
    if strategy.recompute == "selective":
        core = [op for op in profile.ops if op.core]
        return kernels_s(core, scale, cluster), sum(op.fwd_flops for op in core) * scale
    return 0.0, 0.0


def _activations(profile: LayerProfile, strategy: Strategy, tp: int) -> float:
    if strategy.recompute == "full":
        return profile.input_bytes / (tp if strategy.sp else 1)
    saved = profile.saved
    if strategy.recompute == "selective":
        saved -= profile.saved_core
    if strategy.sp:
        saved -= profile.saved_replicated * (1 - 1 / tp)
    return saved


def _temporary(profile: LayerProfile, strategy: Strategy, tp: int,
               fused_loss: bool = False) -> float:
    """Bytes the layer's backward holds for a moment beyond its saved activations, at the
    captured batch: two of the largest tensor one of its ops makes (the gradient arriving at
    that op's output and the one it sends to its input; for the loss, the log-probabilities'
    gradient and the logits'; with a fused loss, Cluster.fused_loss, the logits' alone);
    under recomputation what the recomputed forward saves again."""
    largest = 2 * profile.largest_bytes
    if fused_loss and profile.loss_bytes >= profile.largest_bytes:
        largest = profile.largest_bytes
    if strategy.recompute == "none":
        return largest
    kept = _activations(profile, strategy, tp)
    again = _activations(profile, Strategy(strategy.tp, strategy.sp, "none"), tp) - kept
    return largest + max(again, 0.0)


def _comm(profile, strategy, scale, cluster, tp):
    """(forward seconds, backward seconds, bytes sent once by kind, bytes repeated by kind).
    A collective its recompute mode reruns is sent again in backward."""
    if not strategy.tp or tp == 1:
        return 0.0, 0.0, (), ()
    seconds = {"fwd": 0.0, "bwd": 0.0}
    sent: dict[str, float] = defaultdict(float)
    again: dict[str, float] = defaultdict(float)
    for c in _events(profile, strategy):
        nbytes = c.nbytes * scale if c.per_sample else c.nbytes
        one, wire = collective_time(cluster, c.kind, nbytes, tp), bytes_on_wire(c.kind, nbytes, tp)
        seconds[c.phase] += one
        (again if c.repeated else sent)[c.kind] += wire
        if strategy.recompute in c.rerun:
            seconds["bwd"] += one
            again[c.kind] += wire
    return seconds["fwd"], seconds["bwd"], tuple(sorted(sent.items())), tuple(sorted(again.items()))


def _events(profile: LayerProfile, strategy: Strategy) -> tuple[Collective, ...]:
    """The collectives of the strategy's rewrite. Without a sequence-parallel profile, Megatron's
    swap of each tensor-parallel all-reduce for an all-gather plus a reduce-scatter."""
    if not strategy.sp:
        return profile.collectives
    if profile.sp_collectives is not None:
        return profile.sp_collectives
    return tuple(dataclasses.replace(c, kind=kind) for c in profile.collectives
                 for kind in ("all_gather", "reduce_scatter"))
