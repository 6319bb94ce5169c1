"""Per-operation costs of torch.fx nodes: the bottom of the cost model.

``node_cost(node, modules)`` prices one node of a ``torch.fx.symbolic_trace`` graph
(call_module for torch.nn leaves, call_function/call_method for torch functions
and tensor methods) or of a ``torch.export`` graph (aten overloads, either the
training IR or after ``run_decompositions()``).  Shapes come from
``node.meta["val"]`` as filled by FakeTensorProp or export.

The rules and their conventions (Narayanan et al. 2021 FLOPs, Korthikanti et al.
2022 saved activations) live in ``cost_model.ops.rules`` (matmuls, attention,
norms, embedding, loss) and ``cost_model.ops.tables`` (pointwise ops, views,
casts), over the graph facts of ``cost_model.ops.graph_facts``; this module maps nodes
to rules. An op without a rule is never priced as free nor refused: it gets
``cost_model.ops.fallback``'s conservative memory-bound cost and one
UnpricedOpWarning naming it (once per op per process).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn
from torch.fx import Node

from cost_model.ops import fallback as op_fallback
from cost_model.ops import graph_facts as g
from cost_model.ops import moe
from cost_model.ops import rules as r
from cost_model.ops import tables as t
from cost_model.ops.graph_facts import ZERO, OpCost, saved_node_name

__all__ = ["OpCost", "UnknownOpError", "node_cost", "saved_node_name"]

Rule = Callable[[g.Call], "OpCost | None"]


class UnknownOpError(ValueError):
    """An op with no cost rule; the message names the node, its target and module path."""


_RULES: dict[str, Rule] = {
    "linear": r.linear,
    **dict.fromkeys(("mm", "bmm", "matmul", "addmm", "baddbmm", "mv", "dot", "vdot",
                     "_grouped_mm", "grouped_mm"), r.matmul),
    "einsum": r.einsum,
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "convolution", "_convolution"),
                    r.convolution),
    **dict.fromkeys(("view_as_complex", "view_as_real"), t.view),
    "scaled_dot_product_attention": r.attention,
    "layer_norm": r.norm,
    "rms_norm": r.norm,
    "dropout": r.dropout,
    "embedding": r.embedding,
    "cross_entropy": r.cross_entropy,
    "nll_loss": r.nll_loss,
    # regression losses are memory-bound: read both inputs, write one value (the fallback's
    # pricing, which is right for them, without its warning)
    **dict.fromkeys(("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"),
                    lambda call: op_fallback.cost(call.node, call.modules)),
    **dict.fromkeys(t.POINTWISE, t.pointwise),
    **dict.fromkeys(g.ALWAYS_VIEWS | g.VIEWS_IF_CONTIGUOUS | t.COPIES, t.view),
    "getitem": t.view,
    **dict.fromkeys(g.CASTS, t.cast),
}

# torch.nn leaf modules -> (rule name, rule).
_MODULE_RULES: dict[type, tuple[str, Rule]] = {
    nn.Linear: ("linear", r.linear),
    nn.Embedding: ("embedding", r.embedding),
    nn.LayerNorm: ("layer_norm", r.norm),
    nn.RMSNorm: ("rms_norm", r.norm),
    nn.Dropout: ("dropout", r.dropout),
    nn.GELU: ("gelu", t.pointwise),
    nn.SiLU: ("silu", t.pointwise),
    nn.ReLU: ("relu", t.pointwise),
    nn.Tanh: ("tanh", t.pointwise),
    nn.Sigmoid: ("sigmoid", t.pointwise),
    nn.Softmax: ("softmax", t.pointwise),
    nn.LogSoftmax: ("log_softmax", t.pointwise),
    nn.CrossEntropyLoss: ("cross_entropy", r.cross_entropy),
    nn.Identity: ("identity", t.view),
    nn.Conv1d: ("conv1d", r.convolution),
    nn.Conv2d: ("conv2d", r.convolution),
}

# Functions the rewrite passes insert, by qualified name (importing the passes here would tie the
# bottom of the cost model to them) -> (rule name, rule). The vocabulary-parallel loss is a
# cross-entropy over this rank's logits slice; its all-reduces are priced by layer_cost.
_PASS_FUNCTIONS: dict[str, tuple[str, Rule]] = {
    "passes.rewrite.vocab_parallel.vocab_parallel_cross_entropy": ("cross_entropy",
                                                                    r.vocab_parallel_cross_entropy),
    "runtime.training.rng.tp_dropout": ("dropout", r.dropout),  # a dropout of a tensor-parallel shard
    "runtime.training.rng.tp_scaled_dot_product_attention": ("scaled_dot_product_attention", r.attention),
    "runtime.training.loss_tokens.per_token": ("div", t.pointwise),   # passes.rewrite.token_mean
    "runtime.training.loss_tokens.count_targets": ("sum", t.pointwise),
    moe.QUALNAME: ("moe_ffn", moe.moe_rule),   # a mixture-of-experts layer (cost_model.ops.moe)
    moe.OP_QUALNAME: ("routed_experts", moe.moe_rule),   # its experts, exported as one op
    r.SINK_ATTENTION: ("sink_attention", r.sink_attention),  # GPT-OSS's attention, as one op
}

# Custom ops of other libraries that are matmuls in disguise, by "namespace.name": a grouped
# matmul (a [M, K] by the group's [K, N]) costs 2·M·N·K = 2·numel(out)·K, the matmul rule's count.
_CUSTOM_OPS: dict[str, tuple[str, Rule]] = {
    "transformers.grouped_mm_fallback": ("matmul", r.matmul),
}

# Tensor attributes that are views (x.T, x.mT); other attributes are metadata.
_VIEW_ATTRS = frozenset({"T", "mT", "H", "mH"})


def node_cost(node: Node, modules: Mapping[str, nn.Module]) -> OpCost:
    """Cost of one node; ``modules`` is ``dict(gm.named_modules())``."""
    if node.op in ("placeholder", "get_attr", "output"):
        return ZERO
    if node.op == "call_function" and hasattr(node.target, "_fxpar_collective"):
        return _collective(node)
    if "val" not in node.meta:
        if _returns_no_tensor(node):
            return ZERO
        raise ValueError(f"node {node.name!r} has no meta['val']; run FakeTensorProp first")
    if not g.tensors_in(node.meta["val"]):
        return ZERO  # shape arithmetic, size(): no tensor is produced
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    resolved = _resolve(node, modules, module)
    cost = resolved[1](resolved[0]) if resolved is not None else None
    if cost is None and _index_arithmetic(node):
        return _index_cost(node)
    if cost is None:
        return op_fallback.priced(node, modules, str(_unknown(node, module)))
    return cost


def _index_arithmetic(node: Node) -> bool:
    """Integer/boolean work with no floating input or output (mask and position building, as in
    transformers' mask utilities): nothing to differentiate, so nothing saved and no backward."""
    outputs = g.tensors_in(node.meta.get("val"))
    inputs = [x for a in g.tensor_args(node) for x in g.tensors_in(g.value(a))]
    return bool(outputs) and not any(g.is_float(x) for x in outputs + inputs)


def _index_cost(node: Node) -> OpCost:
    """Memory-bound: read the inputs, write the outputs."""
    moved = sum(g.total_bytes(g.value(a)) for a in g.unique(g.tensor_args(node)))
    moved += g.total_bytes(node.meta.get("val"))
    return OpCost("elementwise", 0.0, 0.0, moved, 0.0, ())


def _resolve(node: Node, modules: Mapping[str, nn.Module],
             module: nn.Module | None) -> tuple[g.Call, Rule] | None:
    if module is not None:
        entry = _module_rule(module)
        return (g.Call(node, entry[0], modules, module), entry[1]) if entry else None
    target = node.target
    qualified = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    if node.op == "call_function" and qualified in _PASS_FUNCTIONS:
        name, rule = _PASS_FUNCTIONS[qualified]
        return g.Call(node, name, modules), rule
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = str(getattr(target, "overloadpacket", target))
        if packet in _CUSTOM_OPS:
            name, rule = _CUSTOM_OPS[packet]
            return g.Call(node, name, modules), rule
    name = g.op_name(node)
    if name == "getattr":  # x.T, x.mT are views; other tensor attributes are not ops
        return (g.Call(node, name, modules), t.view) if node.args[1] in _VIEW_ATTRS else None
    rule = _RULES.get(name)
    return (g.Call(node, name, modules), rule) if rule is not None else None


def _returns_no_tensor(node: Node) -> bool:
    """FakeTensorProp and export store no value for dtype/device/None results:
    attribute reads like ``x.dtype`` and unused checks (asserts, export's _guards_fn)."""
    if not node.users:
        return True
    return node.target is getattr and node.args[1] not in _VIEW_ATTRS


def _module_rule(module: nn.Module) -> tuple[str, Rule] | None:
    for cls in type(module).__mro__:
        if cls in _MODULE_RULES:
            # A subclass that overrides forward computes something else.
            # A subclass that overrides forward computes something else, unless it declares
            # itself a linear (tensor-parallel shards that leave the bias to a later node).
            same = type(module).forward is cls.forward or getattr(module, "fxpar_linear", False)
            return _MODULE_RULES[cls] if same else None
    return None


def _collective(node: Node) -> OpCost:
    """fxpar collectives: no FLOPs here, priced by the comm model from these bytes.

    The size is the full buffer a ring moves: the larger of input and output
    (all_gather grows its input, reduce_scatter shrinks it).  Backward moves the
    same amount (the conjugate collective)."""
    inputs = sum(g.total_bytes(g.value(a)) for a in g.unique(g.tensor_args(node)))
    size = max(inputs, g.total_bytes(node.meta.get("val")))
    return OpCost("comm", 0.0, 0.0, size, size, ())


def _unknown(node: Node, module: nn.Module | None) -> UnknownOpError:
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    target = node.target
    if module is not None:
        what = f"{target} ({type(module).__module__}.{type(module).__qualname__})"
    elif isinstance(target, str):
        what = f"Tensor.{target}"
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        what = str(target)
    else:
        what = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"
    return UnknownOpError(f"no cost rule for node {node.name!r}: {node.op} {what}"
                          f" in module {path or '<root>'!r}")
