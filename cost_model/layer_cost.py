"""Price one layer under one strategy, from its graph.

`profile_layer` cuts the layer out of the captured graph, applies the tensor-parallel rewrite when
asked, re-propagates fake shapes and counts every node (cost_model.ops). `price` turns a profile into
times and bytes for a micro-batch size and a strategy:

  activations  saved-for-backward bytes, deduplicated by tensor; sequence parallel divides the
               tensors the TP rewrite left replicated by t; selective recompute drops the
               attention core (tensors of shape [..., s, s]); full recompute keeps only the inputs.
  compute      Σ roofline(op) forward and backward; recompute adds the recomputed forward.
  comm         the collectives the rewrite inserted, priced by alpha-beta ring models.
Everything is linear in the micro-batch size, so profiles are taken once at the captured batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

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
    core: bool                     # part of the attention core (output of shape [..., s, s])


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


def _extract(gm: fx.GraphModule, layer: Layer) -> fx.GraphModule:
    """The layer alone as a graph whose placeholders are its inputs (meta shapes kept)."""
    mine = set(layer.nodes)
    node_stage, stage = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stage = 1 if node.name in mine else (0 if stage == 0 else 2)
        node_stage[node.name] = stage
    program = split_stages(gm, node_stage, 3)[1]
    return program.gm


def _fake_inputs(sub: fx.GraphModule) -> list[torch.Tensor]:
    inputs = []
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            inputs.append(torch.empty(val.shape, dtype=val.dtype, device="meta"))
    return inputs


def profile_layer(captured: Captured, layer: Layer, tp: int = 1) -> LayerProfile:
    sub = _extract(captured.gm, layer)
    inputs = _fake_inputs(sub)
    replicated_names = None
    if tp > 1:
        base_saved = _saved(sub)
        tensor_parallel(sub, {layer.name: [n.name for n in sub.graph.nodes]}, tp, 0)
        propagate_shapes(sub, inputs)
        replicated_names = {k for k, v in _saved(sub).items() if base_saved.get(k) == v}
    else:
        propagate_shapes(sub, inputs)
    return _profile(sub, layer, tp, replicated_names)


def _saved(sub: fx.GraphModule) -> dict[str, float]:
    modules = dict(sub.named_modules())
    saved: dict[str, float] = {}
    for node in sub.graph.nodes:
        for name, nbytes in node_cost(node, modules).saved:
            saved[name] = nbytes
    return saved


def _is_core(val, seq: int) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == val.shape[-2] == seq


def _profile(sub: fx.GraphModule, layer: Layer, tp: int, replicated: set[str] | None):
    modules = dict(sub.named_modules())
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    first = placeholders[0].meta["val"]
    batch = first.shape[0]
    seq = first.shape[1] if first.dim() > 1 else 1
    values = {n.name: n.meta.get("val") for n in sub.graph.nodes}
    ops, saved, collectives = [], {}, []
    for node in sub.graph.nodes:
        cost = node_cost(node, modules)
        kind = getattr(node.target, "_fxpar_collective", None)
        if kind:
            nbytes = _bytes(node.meta.get("val"))
            phase = "bwd" if kind.endswith("_backward") else "fwd"
            collectives.append(Collective(kind.removesuffix("_backward"), phase, nbytes))
            continue
        ops.append(OpRecord(cost.op_class, cost.fwd_flops, cost.bwd_flops, cost.fwd_bytes,
                            cost.bwd_bytes, cost.matmul_flops, _is_core(node.meta.get("val"), seq)))
        saved.update(dict(cost.saved))
    out = next(n for n in sub.graph.nodes if n.op == "output")
    return LayerProfile(
        layer.name, layer.kind, tp, batch, tuple(ops),
        saved=sum(saved.values()),
        saved_core=sum(b for k, b in saved.items() if _is_core(values.get(saved_node_name(k)), seq)),
        saved_replicated=sum(b for k, b in saved.items() if replicated and k in replicated),
        input_bytes=sum(_bytes(p.meta["val"]) for p in placeholders
                        if p.meta["val"].dtype.is_floating_point),
        output_bytes=_bytes(fx.node.map_arg(out.args[0], lambda n: n.meta.get("val"))),
        params=sum(p.numel() for p in sub.parameters()),
        collectives=tuple(collectives))


def _bytes(val) -> float:
    if isinstance(val, torch.Tensor):
        return float(val.numel() * val.element_size())
    if isinstance(val, (tuple, list)):
        return float(sum(_bytes(v) for v in val))
    return 0.0


def price(profile: LayerProfile, strategy: Strategy, micro_batch: int, cluster: Cluster,
          tp: int = 1) -> LayerCost:
    """Times and bytes of the profiled layer for a micro-batch; tp is the group size of the mesh."""
    scale = micro_batch / profile.batch
    fwd = sum(compute_time(cluster, op.fwd_flops * scale, op.fwd_bytes * scale, op.op_class)
              for op in profile.ops)
    bwd = sum(compute_time(cluster, op.bwd_flops * scale, op.bwd_bytes * scale, op.op_class)
              for op in profile.ops)
    fwd_flops = sum(op.fwd_flops for op in profile.ops) * scale
    model_flops = fwd_flops + sum(op.bwd_flops for op in profile.ops) * scale
    recompute_s, recompute_flops = _recompute(profile, strategy, scale, cluster, fwd, fwd_flops)
    comm_s, comm_bytes = _comm(profile, strategy, scale, cluster, tp)
    return LayerCost(profile.layer, strategy, micro_batch,
                     fwd_s=fwd + comm_s / 2, bwd_s=bwd + recompute_s + comm_s / 2, comm_s=comm_s,
                     flops=model_flops + recompute_flops, model_flops=model_flops,
                     act_bytes=_activations(profile, strategy, tp) * scale,
                     params=profile.params, comm_bytes=comm_bytes)


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
