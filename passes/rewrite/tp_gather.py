"""Column-parallel linears whose output is gathered whole: a DiT's adaLN modulation.

A DiT block computes six vectors from its conditioning c in one Linear(h, 6h), cut by
`.unsqueeze(1).chunk(6, dim=-1)`; each scales, shifts or gates the hidden state, which every
tensor-parallel rank holds whole outside the attention and MLP regions. Megatron's pairing has
no row-parallel partner for it: cut by output features, each part would be 1/tp of a vector
meeting the whole hidden state. Two exact ways remain:

  whole on every rank      no communication: its input and every consumer are replicated, so
                           its gradients are the same on every rank with no sum; but it holds
                           6h² of a block's 18h² weights (a third) on every rank.
  column-parallel,         (chosen) each rank holds a contiguous block of the 6h output features
  output all-gathered      (the weight is 1/tp per rank), and `tp_gather` all-gathers the blocks
                           into the whole [b, 6h] forward: b·6h elements, tiny beside the
                           block's [b, s, h] all-reduces. Backward, the gradient of the gathered
                           output is the same on every rank (its consumers are replicated; under
                           sequence parallelism the rewrite first sums over the group the
                           gradients of the parts broadcast over each rank's patches,
                           tp_grad_sum), so each rank keeps its own block of it: a reduce-scatter
                           would add tp equal copies and multiply it by tp. The input enters
                           through tp_copy like any column-parallel linear's, since each rank's
                           input gradient is the partial sum over its output features (an
                           all-reduce of b·h backward).

When: the dataflow check (passes.rewrite.tp_dataflow) would refuse a column-parallel output's
parts - a split of it that is not read per rank (one after a view, as `unsqueeze(1).chunk(6)`),
or a part that meets a value whole along the features (`x * (1 + scale)`) - and the value comes
from the linear through views, that split and ops with constants only (`1 + scale`). The check
then runs again with the linear gathered (`GatherNeeded`); anything else that looks across a
sharded dimension stays refused, with its reason. The final layer's Linear(h, 2h) is the same
pattern in the head, which runs whole on its stage.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx
import torch.nn as nn

from passes.rewrite.sharding import (LinearSite, ShardingError, ShardSpec, call_after,
                                     linear_site, shard_outputs, shard_param)
from runtime.comm import collectives

_VIEWS = {"unsqueeze", "squeeze", "view", "reshape", "_unsafe_view", "flatten", "unflatten",
          "contiguous", "expand"}
_SPLITS = {"chunk", "split", "split_with_sizes"}
# ops that, given one tensor and constants, keep the sharded features where they are
_WITH_CONSTANTS = {"add", "sub", "mul", "div", "truediv", "neg", "to", "type", "float", "half",
                   "bfloat16", "_to_copy", "clone", "silu", "sigmoid", "tanh", "gelu", "relu"}


class GatherNeeded(Exception):
    """Raised inside the dataflow check: `linear` is to be gathered, and the check rerun."""

    def __init__(self, linear: fx.Node, reason: str = ""):
        super().__init__(linear.name)
        self.linear, self.reason = linear, reason   # the refusal gathering it avoids


def modulation_source(gm: fx.GraphModule, value: fx.Node, op_name: Callable,
                      split: bool = False) -> fx.Node | None:
    """The linear whose output `value` is a part of - reached back through views, getitems of a
    split, the split itself, and ops whose other operands are constants - when that path holds
    a split of it along the way or `split` says the op refused is one; else None."""
    node = value
    while isinstance(node, fx.Node):
        if linear_site(gm, node) is not None:
            return node if split else None
        name = op_name(gm, node)
        inputs = node.all_input_nodes
        if node.target is operator.getitem:
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            inserts = all(i is None or i is Ellipsis or i == slice(None) for i in index)
            if not isinstance(node.args[0], fx.Node) or (
                    op_name(gm, node.args[0]) not in _SPLITS and not inserts):
                return None  # indexing a tensor, not taking a part of a split
            node = node.args[0]  # a part of a split, or x[:, None, :] (a view)
        elif name in _SPLITS:
            split, node = True, node.args[0]
        elif len(inputs) == 1 and (name in _VIEWS or name in _WITH_CONSTANTS):
            node = inputs[0]
        else:
            return None
    return None


class GatheredLinear(nn.Linear):
    """Holds a contiguous block of a linear's output rows (and bias) whose output is then
    gathered. A Linear, so op pricing sees its local shape."""

    def __init__(self, full: nn.Linear, spec: ShardSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = full.in_features, full.out_features // spec.parts
        self.weight = shard_param(full.weight, spec)
        self.bias = shard_param(full.bias, spec) if full.bias is not None else None


def gather_column(gm: fx.GraphModule, site: LinearSite, layer: str, tp: int, rank: int,
                  group: str) -> fx.Node:
    """Make `site` column-parallel in contiguous blocks of its output features (so the gather
    puts them back in order, whatever split follows) and gather its output; returns the
    gathered node, which every former reader of the linear now reads."""
    width = site.features(gm, site.out_dim)
    if width % tp:
        raise ShardingError(f"layer {layer}: {site.name} has {width} output features (dim "
                            f"{site.out_dim} of its weight), gathered whole after the linear, "
                            f"not divisible by tp={tp}")
    shard_outputs(gm, site, ShardSpec(site.out_dim, tp, rank), GatheredLinear, layer)
    features = site.node.meta["val"].dim() - 1
    return call_after(gm, site.node, collectives.tp_gather, (group, layer, tp, features), layer)
