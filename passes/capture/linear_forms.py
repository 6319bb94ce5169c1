"""A product with a transposed weight, `x @ w.T`, made the linear it is: `F.linear(x, w)`.

Falcon's `FalconLinear` (an `nn.Linear` whose forward is `input @ self.weight.T`), and models
that write their projections as products, reach the graph as a matmul of a transposed
2-D parameter: the tensor-parallel rewrite, which splits linears, would find nothing to split,
and the block would run whole on every rank of its tp group. The capture rewrites such a
product, with a bias parameter added right after it, into the linear it computes (aten.linear
in an exported graph): the same product of the same values.
"""
from __future__ import annotations

import builtins
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten
_MATMULS = {operator.matmul, torch.matmul, aten.matmul.default}
_ADDS = {operator.add, torch.add, aten.add.Tensor}


def products_to_linears(gm: fx.GraphModule) -> None:
    """Every `matmul(x, transposed 2-D parameter)` -> linear(x, parameter[, bias])."""
    changed = False
    for node in list(gm.graph.nodes):
        weight = _transposed_weight(gm, node)
        if weight is None:
            continue
        exported, transposed = node.target is aten.matmul.default, node.args[1]
        bias = _added_bias(gm, node, weight)
        args = (node.args[0], weight) + ((bias.args[1],) if bias is not None else ())
        replaced = bias if bias is not None else node   # after all it reads (a bias read late)
        with gm.graph.inserting_before(replaced):
            linear = gm.graph.call_function(aten.linear.default if exported else F.linear, args)
        linear.meta = dict(replaced.meta)
        replaced.replace_all_uses_with(linear)
        for dead in ((bias, node) if bias is not None else (node,)):
            gm.graph.erase_node(dead)
        if not transposed.users:
            gm.graph.erase_node(transposed)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _transposed_weight(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The get_attr of the 2-D parameter `node` multiplies by, transposed, or None."""
    is_matmul = (node.op == "call_function" and node.target in _MATMULS) or \
        (node.op == "call_method" and node.target == "matmul")
    if not is_matmul or len(node.args) != 2 or node.kwargs:
        return None
    t = node.args[1]
    if not isinstance(t, fx.Node) or not t.args or not isinstance(t.args[0], fx.Node):
        return None
    source = t.args[0]
    param = _parameter(gm, source)
    if param is None or param.dim() != 2 or not _transposes(t):
        return None
    return source


def _transposes(t: fx.Node) -> bool:
    """Whether `t` is the transpose of the 2-D tensor it reads, in any of the forms it is
    written in: w.T, w.t(), w.transpose(0, 1), w.permute(1, 0) (and their aten ops)."""
    rest = tuple(t.args[1:])
    if t.op == "call_function" and t.target is builtins.getattr:
        return rest in (("T",), ("mT",))
    if t.op == "call_method" or t.target in (torch.t, torch.transpose, torch.permute):
        name = t.target if t.op == "call_method" else t.target.__name__
        if name == "t":
            return not rest
        if name == "transpose":
            return len(rest) == 2 and {d % 2 for d in rest} == {0, 1}
        if name == "permute":
            dims = rest[0] if len(rest) == 1 else rest
            return tuple(d % 2 for d in dims) == (1, 0)
        return False
    if t.target in (aten.numpy_T.default, aten.t.default):
        return not rest
    if t.target is aten.transpose.int:
        return len(rest) == 2 and {d % 2 for d in rest} == {0, 1}
    if t.target is aten.permute.default:
        return tuple(d % 2 for d in rest[0]) == (1, 0)
    return False


def _added_bias(gm: fx.GraphModule, product: fx.Node, weight: fx.Node) -> fx.Node | None:
    """The add of a 1-D parameter of the weight's out features right after `product`, read
    by nothing else (FalconLinear's `hidden_states + self.bias`), or None."""
    if len(product.users) != 1:
        return None
    (add,) = product.users
    if add.op != "call_function" or add.target not in _ADDS or add.kwargs or \
            len(add.args) != 2 or add.args[0] is not product:
        return None
    bias = add.args[1]
    value = _parameter(gm, bias) if isinstance(bias, fx.Node) else None
    out_features = _parameter(gm, weight).shape[0]
    return add if value is not None and tuple(value.shape) == (out_features,) else None


def _parameter(gm: fx.GraphModule, node: fx.Node) -> nn.Parameter | None:
    if node.op != "get_attr":
        return None
    prefix, _, name = str(node.target).rpartition(".")
    try:
        value = getattr(gm.get_submodule(prefix) if prefix else gm, name)
    except AttributeError:
        return None
    return value if isinstance(value, nn.Parameter) else None
