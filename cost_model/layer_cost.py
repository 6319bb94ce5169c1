"""Price one layer under one strategy, from its graph.

`profile_layer` cuts the layer out of the captured graph, applies the tensor-parallel rewrite when
asked, re-propagates fake shapes and counts every node (cost_model.ops). `price` turns a profile into
times and bytes for a micro-batch size and a strategy:

  activations  saved-for-backward bytes, deduplicated by tensor (Korthikanti et al. 2022 count per
               GPT layer: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) under tensor parallelism).
               Sequence parallel divides the tensors the TP rewrite left replicated (the layer
               input, the norms' inputs and outputs, the dropout masks after each row-parallel
               reduce: 10sbh) by t; selective recompute drops the attention core (the scores and
               everything computed from them up to the attention-over-values matmul: softmax
               output, dropout mask and dropout output, 5as²b); full recompute keeps only the
               layer input.
  compute      Σ roofline(op) forward and backward; recompute adds the recomputed forward.
  comm         the collectives the rewrite inserted, priced by alpha-beta ring models.
Everything is linear in the micro-batch size, so profiles are taken once at the captured batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from cost_model import op_rules
from cost_model.cluster import Cluster
from cost_model.comm import bytes_on_wire, collective_time
from cost_model.compute import compute_time
from cost_model.ops import node_cost, saved_node_name
from cost_model.strategy import Strategy
from passes.capture import Captured, Layer, propagate_shapes
from passes.pipeline_split import split_stages
from passes.tensor_parallel import tensor_parallel


@dataclass(frozen=True)
class OpRecord:
    op_class: str
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    matmul_flops: float
    core: bool                     # part of the attention core (see _core_nodes)


@dataclass(frozen=True)
class Collective:
    kind: str                      # "all_reduce", ...
    phase: str                     # "fwd" | "bwd"
    nbytes: float                  # full tensor size at the captured batch


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
    comm_bytes: tuple[tuple[str, float], ...]   # (kind, bytes sent per rank)


def _extract(captured: Captured, layer: Layer) -> fx.GraphModule:
    """The layer alone as a graph whose placeholders are its inputs (meta shapes kept): a
    three-stage split into the layers before it, the layer, and the layers after it. By layer
    index, not graph position: exported graphs list every parameter's get_attr first."""
    index = {l.name: l.index for l in captured.layers}
    node_stage = {node: (index[owner] > layer.index) * 2 if owner != layer.name else 1
                  for node, owner in captured.layer_of().items()}
    program = split_stages(captured.gm, node_stage, 3)[1]
    return program.gm


def _fake_inputs(sub: fx.GraphModule) -> list[torch.Tensor]:
    inputs = []
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            inputs.append(torch.empty(val.shape, dtype=val.dtype, device="meta"))
    return inputs


def profile_layer(captured: Captured, layer: Layer, tp: int = 1) -> LayerProfile:
    sub = _extract(captured, layer)
    inputs = _fake_inputs(sub)
    replicated_names = None
    if tp > 1:
        base_saved = _saved(sub)
        tensor_parallel(sub, {layer.name: [n.name for n in sub.graph.nodes]}, tp, 0)
        propagate_shapes(sub, inputs)
        # A tensor the rewrite did not shrink is held whole on every rank: sequence parallel is
        # what shards it.
        replicated_names = {k for k, v in _saved(sub).items() if base_saved.get(k) == v}
    else:
        propagate_shapes(sub, inputs)
    return _profile(sub, layer, tp, replicated_names, captured.batch, captured.seq)


def _identity_forward(node: fx.Node) -> bool:
    """A collective that passes its input through unchanged in forward (tp_copy, tp_grad_sum): a
    tensor kept after it is the tensor kept before it, under the name of its source."""
    kind = getattr(node.target, "_fxpar_collective", "")
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return (kind.endswith("_backward") and src is not None
            and _bytes(node.meta.get("val")) == _bytes(src.meta.get("val")))


def _canonical(name: str, nodes: dict[str, fx.Node], modules) -> str:
    """A saved entry's name, followed back through identity-forward collectives and views."""
    node_name, suffix = saved_node_name(name), name[len(saved_node_name(name)):]
    node = nodes.get(node_name)
    if node is None or not _identity_forward(node):
        return name
    while _identity_forward(node):
        node = op_rules.alias_root(node.args[0], modules)
    return node.name + suffix


def _saved_entries(sub: fx.GraphModule):
    """(canonical saved name, bytes) of every node, in graph order."""
    modules, nodes = dict(sub.named_modules()), {n.name: n for n in sub.graph.nodes}
    for node in sub.graph.nodes:
        for name, nbytes in node_cost(node, modules).saved:
            yield _canonical(name, nodes, modules), nbytes


def _saved(sub: fx.GraphModule) -> dict[str, float]:
    return dict(_saved_entries(sub))


def _core_nodes(sub: fx.GraphModule, seq: int) -> set[str]:
    """The attention core: the scores (an [..., s, s] product of two activations, QKᵀ) and every
    non-matmul op computed from them at their shape (scale, mask, softmax, dropout), stopping at
    the attention-over-values matmul. Found by structure, not by shape alone, so that a
    [b, s, h] tensor with h == s is never mistaken for scores."""
    modules = dict(sub.named_modules())
    core: set[str] = set()
    for node in sub.graph.nodes:
        val = node.meta.get("val")
        if not _square(val, seq) or node.op in ("placeholder", "get_attr", "output"):
            continue
        cost_class = node_cost(node, modules).op_class
        args = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if cost_class == "matmul":
            if len(args) >= 2 and all(op_rules.kind(a) == "activation" for a in args[:2]):
                core.add(node.name)
        elif any(a.name in core and a.meta["val"].shape == val.shape for a in args):
            core.add(node.name)
    return core


def _square(val, seq: int) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == val.shape[-2] == seq


def _profile(sub: fx.GraphModule, layer: Layer, tp: int, replicated: set[str] | None,
             batch: int, seq: int):
    modules = dict(sub.named_modules())
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    core = _core_nodes(sub, seq)
    ops, collectives, kv_bytes = [], [], 0.0
    for node in sub.graph.nodes:
        kind = getattr(node.target, "_fxpar_collective", None)
        if kind:
            nbytes = _bytes(node.meta.get("val"))
            phase = "bwd" if kind.endswith("_backward") else "fwd"
            collectives.append(Collective(kind.removesuffix("_backward"), phase, nbytes))
            continue
        cost = node_cost(node, modules)
        ops.append(OpRecord(cost.op_class, cost.fwd_flops, cost.bwd_flops, cost.fwd_bytes,
                            cost.bwd_bytes, cost.matmul_flops, node.name in core))
        if cost.op_class == "attention":
            kv_bytes += sum(_bytes(arg.meta.get("val")) for arg in node.args[1:3])
    saved = _saved(sub)
    out = next(n for n in sub.graph.nodes if n.op == "output")
    return LayerProfile(
        layer.name, layer.kind, tp, batch, tuple(ops),
        saved=sum(saved.values()),
        saved_core=sum(b for k, b in saved.items() if saved_node_name(k) in core),
        saved_replicated=sum(b for k, b in saved.items() if replicated and k in replicated),
        input_bytes=sum(_bytes(p.meta["val"]) for p in placeholders
                        if p.meta["val"].dtype.is_floating_point),
        output_bytes=_bytes(fx.node.map_arg(out.args[0], lambda n: n.meta.get("val"))),
        params=sum(p.numel() for p in sub.parameters()),
        collectives=tuple(collectives), kv_bytes=kv_bytes)


def _bytes(val) -> float:
    if isinstance(val, torch.Tensor):
        return float(val.numel() * val.element_size())
    if isinstance(val, (tuple, list)):
        return float(sum(_bytes(v) for v in val))
    return 0.0


def price(profile: LayerProfile, strategy: Strategy, micro_batch: int, cluster: Cluster,
          tp: int = 1, cp: int = 1) -> LayerCost:
    """Times and bytes of the profiled layer for a micro-batch; tp and cp are the group sizes of
    the mesh. Context parallelism gives each rank 1/cp of the tokens — zig-zag sharding balances
    causal attention too — and adds the key/value ring (`_ring`)."""
    scale = micro_batch / profile.batch / cp
    fwd = sum(compute_time(cluster, op.fwd_flops * scale, op.fwd_bytes * scale, op.op_class)
              for op in profile.ops)
    bwd = sum(compute_time(cluster, op.bwd_flops * scale, op.bwd_bytes * scale, op.op_class)
              for op in profile.ops)
    fwd_flops = sum(op.fwd_flops for op in profile.ops) * scale
    model_flops = fwd_flops + sum(op.bwd_flops for op in profile.ops) * scale
    recompute_s, recompute_flops = _recompute(profile, strategy, scale, cluster, fwd, fwd_flops)
    comm_s, comm_bytes = _comm(profile, strategy, scale, cluster, tp)
    if cp > 1:
        ring_s, ring_bytes = _ring(profile, scale, cluster, tp, cp)
        comm_s += ring_s
        comm_bytes = tuple(sorted(comm_bytes + (("p2p", ring_bytes),)))
    return LayerCost(profile.layer, strategy, micro_batch,
                     fwd_s=fwd + comm_s / 2, bwd_s=bwd + recompute_s + comm_s / 2, comm_s=comm_s,
                     flops=model_flops + recompute_flops, model_flops=model_flops,
                     act_bytes=_activations(profile, strategy, tp) * scale,
                     params=profile.params, comm_bytes=comm_bytes)


def _ring(profile: LayerProfile, scale: float, cluster: Cluster, tp: int, cp: int):
    """Exposed seconds and bytes sent of ring attention per micro-batch: forward passes this
    rank's key/value block cp − 1 times; backward passes it again and carries fp32 dK/dV
    accumulators cp hops home. Each transfer overlaps the attention computed on the block in hand,
    so only what the transfers exceed the attention time is exposed."""
    kv = profile.kv_bytes * scale
    sent = (cp - 1) * kv + (cp - 1) * kv + cp * 2 * kv
    hop = lambda nbytes: collective_time(cluster, "p2p", nbytes, 2, stride=tp)  # noqa: E731
    transfer = 2 * (cp - 1) * hop(kv) + cp * hop(2 * kv)
    attention = sum(compute_time(cluster, (op.fwd_flops + op.bwd_flops) * scale,
                                 (op.fwd_bytes + op.bwd_bytes) * scale, op.op_class)
                    for op in profile.ops if op.op_class == "attention")
    return max(0.0, transfer - attention), sent


def _recompute(profile, strategy, scale, cluster, fwd_s, fwd_flops):
    if strategy.recompute == "full":
        return fwd_s, fwd_flops
    if strategy.recompute == "selective":
        core = [op for op in profile.ops if op.core]
        return (sum(compute_time(cluster, op.fwd_flops * scale, op.fwd_bytes * scale, op.op_class)
                    for op in core), sum(op.fwd_flops for op in core) * scale)
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


def _comm(profile, strategy, scale, cluster, tp) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Sequence parallel swaps each all-reduce for an all-gather plus a reduce-scatter: the same
    ring volume, twice the latency terms."""
    if not strategy.tp or tp == 1:
        return 0.0, ()
    total, sent = 0.0, {}
    for c in profile.collectives:
        nbytes = c.nbytes * scale
        kinds = ["all_gather", "reduce_scatter"] if strategy.sp else [c.kind]
        for kind in kinds:
            total += collective_time(cluster, kind, nbytes, tp)
            sent[kind] = sent.get(kind, 0.0) + bytes_on_wire(kind, nbytes, tp)
    return total, tuple(sorted(sent.items()))
