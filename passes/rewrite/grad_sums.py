"""Gradients of whole parameters read by part of a value: a module's parameters (a norm's
weight applied to this rank's heads under tensor parallelism, or to its tokens under sequence
parallelism) get on each rank only that part's gradient, summed over the group here."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from passes.rewrite.sharding import LAYER
from runtime.comm import collectives as c


def with_params(module: nn.Module, params: dict, *args, **kwargs):
    """module(*args, **kwargs) computed with `params` (name -> tensor) in place of its own."""
    return torch.func.functional_call(module, dict(params), args, dict(kwargs))


def module_params_summed(gm: fx.GraphModule, node: fx.Node, layer: str, group: str) -> fx.Node:
    """A module call (a norm's weight) applied to part of a value - this rank's heads, or its
    tokens under sequence parallelism - gets only that part's gradient for its whole trained
    parameters: called through `with_params` with each read through tp_grad_sum, which sums
    the gradient over the group. Returns the node now computing it."""
    module = gm.get_submodule(node.target)
    params = [name for name, p in module.named_parameters() if p.requires_grad]
    if not params:
        return node
    graph = gm.graph
    with graph.inserting_before(node):
        held = graph.get_attr(node.target)
        summed = {}
        for name in params:
            attr = graph.get_attr(f"{node.target}.{name}")
            summed[name] = graph.call_function(c.tp_grad_sum, (attr, group, layer))
            attr.meta[LAYER] = summed[name].meta[LAYER] = layer
        call = graph.call_function(with_params, (held, summed, *node.args), node.kwargs)
    held.meta[LAYER] = layer
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    return call
