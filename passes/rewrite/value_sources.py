"""What a value in a layer's graph is computed from, as far as the graph shows: constants alone
(marked by the capture, passes.capture.trace.CONSTANT), or trained parameters and activations,
which give it a gradient. Tensor parallelism asks it of values every rank holds whole: one with a
gradient that meets sharded values gets on each rank only its share of that gradient."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from passes.capture.trace import CONSTANT


def trained_param(gm: fx.GraphModule, node: fx.Node) -> bool:
    """`node` reads a trained parameter by get_attr."""
    prefix, _, name = str(node.target).rpartition(".")
    param = getattr(gm.get_submodule(prefix) if prefix else gm, name, None)
    return isinstance(param, nn.Parameter) and param.requires_grad


def is_size(node: fx.Node) -> bool:
    """A size or shape read at run time (an int, a SymInt, or a tuple of them)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return bool(values) and all(isinstance(v, (int, torch.SymInt)) for v in values)


def is_constant(gm: fx.GraphModule, value: fx.Node, limit: int = 256) -> bool:
    """Whether `value` and what it is computed from are marked constant by the capture (a
    placeholder of a layer cut out of the graph keeps its mark) and read no trained parameter."""
    seen, stack = set(), [value]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > limit:
            return False
        if node.op == "get_attr":
            if trained_param(gm, node):
                return False
            continue
        if not node.meta.get(CONSTANT):
            return False
        stack.extend(node.all_input_nodes)
    return True


def carries_grad(gm: fx.GraphModule, value: fx.Node, limit: int = 256) -> bool:
    """Whether `value` is computed from a trained parameter or an input not marked constant (an
    activation): not from buffers (rotary tables), sizes and constants alone. Past `limit` nodes
    it is taken to carry one."""
    seen, stack = set(), [value]
    while stack:
        node = stack.pop()
        if node in seen or node.meta.get(CONSTANT) or is_size(node):
            continue  # sizes, read from a tensor, carry no gradient
        seen.add(node)
        if len(seen) > limit or node.op == "placeholder":
            return True
        if node.op == "get_attr":
            if trained_param(gm, node):
                return True
            continue
        stack.extend(node.all_input_nodes)
    return False
