"""Tensor-parallel rewrite (Megatron pairing) of the linear layers of chosen layers.

Within a layer, walking nodes in order, every tensor is either replicated or sharded on its last
(feature / head) dimension. A linear whose input is replicated becomes column-parallel (its output
rows are split, so its output is sharded); a linear whose input is sharded becomes row-parallel
(its input columns are split, its output is a partial sum). Any other op with a sharded input gives
a sharded output — heads never mix in attention, and the MLP activation is elementwise.
Collectives inserted, as named call nodes:
  tp_copy(x)        before each column-parallel linear (identity forward, all-reduce backward)
  tp_all_reduce(y)  after each row-parallel linear, before its bias is added
so each attention and MLP pair costs one all-reduce forward and one backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from runtime import collectives


class ShardingError(ValueError):
    """A split that does not divide; names the layer, the dimension and the divisor."""


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter was cut: dimension, shard count, this rank's index, and interleaved chunks."""

    dim: int
    parts: int
    index: int
    chunks: int = 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        pieces = full.unflatten(self.dim, (self.chunks, -1))
        shard = pieces.chunk(self.parts, dim=self.dim + 1)[self.index]
        return shard.flatten(self.dim, self.dim + 1).clone()

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        pieces = [s.unflatten(self.dim, (self.chunks, -1)) for s in shards]
        return torch.cat(pieces, dim=self.dim + 1).flatten(self.dim, self.dim + 1)


class ColumnParallelLinear(nn.Linear):
    """Holds its output-row shard (and bias shard). A Linear, so op pricing sees its local shape."""

    def __init__(self, full: nn.Linear, spec: ShardSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = full.in_features, full.out_features // spec.parts
        self.weight = nn.Parameter(spec.take(full.weight.detach()), full.weight.requires_grad)
        self.bias = (nn.Parameter(spec.take(full.bias.detach()), full.bias.requires_grad)
                     if full.bias is not None else None)
        self.shard_specs = {"weight": spec, "bias": spec}


class RowParallelLinear(nn.Linear):
    """Holds its input-column shard; the bias (replicated) is added in the graph after the reduce."""

    def __init__(self, full: nn.Linear, spec: ShardSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = full.in_features // spec.parts, full.out_features
        self.weight = nn.Parameter(spec.take(full.weight.detach()), full.weight.requires_grad)
        self.bias = full.bias
        self.shard_specs = {"weight": spec}

    # A Linear computing x @ weight.T without its bias: cost rules price it as a linear.
    fxpar_linear = True

    def forward(self, x):
        return F.linear(x, self.weight)


def tensor_parallel(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]], tp: int, rank: int,
                    group: str = "tp") -> fx.GraphModule:
    """Shard the linears of `layers` (layer name -> its node names) over `tp` ranks; in place."""
    if tp == 1:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    for layer, names in layers.items():
        _shard_layer(gm, layer, [nodes[n] for n in names if n in nodes], tp, rank, group)
    gm.graph.lint()
    gm.recompile()
    return gm


def _shard_layer(gm, layer: str, nodes: list[fx.Node], tp: int, rank: int, group: str) -> None:
    sharded: set[fx.Node] = set()
    entered: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, nn.Linear):
            (source,) = node.all_input_nodes
            if source in sharded:
                _make_row(gm, node, module, layer, tp, rank, group)
            else:
                _make_column(gm, node, module, layer, tp, rank)
                if source not in entered.values():  # one region entry per value (q, k, v share it)
                    entered[source] = _insert_after(gm, source, collectives.tp_copy, group, layer)
                sharded.add(node)
        elif any(arg in sharded for arg in node.all_input_nodes):
            _check_heads(node, layer, tp)
            sharded.add(node)


def _chunks(node: fx.Node) -> int:
    """A fused projection whose output is split into k equal parts (QKV) is sharded per part."""
    users = list(node.users)
    if len(users) == 1 and users[0].target in ("chunk", torch.chunk):
        return int(users[0].args[1])
    return 1


def _make_column(gm, node, module: nn.Linear, layer: str, tp: int, rank: int) -> None:
    chunks = _chunks(node)
    if module.out_features % (chunks * tp):
        raise ShardingError(f"layer {layer}: {node.target}.out_features={module.out_features} "
                            f"(in {chunks} parts) is not divisible by tp={tp}")
    gm.add_submodule(node.target, ColumnParallelLinear(module, ShardSpec(0, tp, rank, chunks)))


def _make_row(gm, node, module: nn.Linear, layer: str, tp: int, rank: int, group: str) -> None:
    if module.in_features % tp:
        raise ShardingError(f"layer {layer}: {node.target}.in_features={module.in_features} "
                            f"is not divisible by tp={tp}")
    gm.add_submodule(node.target, RowParallelLinear(module, ShardSpec(1, tp, rank)))
    reduced = _insert_after(gm, node, collectives.tp_all_reduce, group, layer)
    if module.bias is not None:
        with gm.graph.inserting_after(reduced):
            bias = gm.graph.get_attr(f"{node.target}.bias")
        with gm.graph.inserting_after(bias):
            added = gm.graph.call_function(torch.add, (reduced, bias))
        reduced.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)


def _insert_after(gm, node: fx.Node, fn, group: str, layer: str) -> fx.Node:
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(fn, (node, group, layer))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    new.meta = dict(node.meta)
    return new


def _check_heads(node: fx.Node, layer: str, tp: int) -> None:
    """Splitting features into heads must not cut a head: the local width must hold whole heads."""
    if node.target == "unflatten" and node.args[1] == -1:
        head_dim = node.args[2][1]
        source = node.args[0].meta.get("val")
        if source is not None and (source.shape[-1] // tp) % head_dim:
            raise ShardingError(f"layer {layer}: {source.shape[-1] // head_dim} heads of "
                                f"{node.name} are not divisible by tp={tp}")


def shard_specs(gm: nn.Module) -> dict[str, ShardSpec]:
    """Parameter name -> how it was sharded, for every sharded parameter of a rewritten module."""
    specs = {}
    for name, module in gm.named_modules():
        for param, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{name}.{param}" if name else param] = spec
    return specs
