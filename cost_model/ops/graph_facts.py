"""Graph facts the per-operation cost rules read, and the OpCost they return.

``cost_model.ops.rules`` (matmuls, attention, norms, embedding, loss) and
``cost_model.ops.tables`` (pointwise ops by table, views, casts) price one fx node
each; this module holds what they share: tensor sizes from ``node.meta["val"]``,
one rule name per op across its spellings, whether a value is an activation, a
parameter or a constant, and which node owns the storage a view aliases.

Saved-for-backward naming, and why (Korthikanti et al. 2022 count each tensor once):

* each rule names the node whose value autograd keeps, walked back through pure
  views to the node that owns the storage, so a tensor kept by two ops (or through
  two views) dedups to one name.  Parameters, buffers and constants are never
  counted: they live for the whole step anyway.
* A kept tensor that is no node's value (dropout mask, attention log-sum-exp,
  cross-entropy log-softmax) is named ``"<node>:<what>"``; the suffix keeps it from
  deduping against the node's own output (``att @ v`` keeps the dropout output
  *and* the dropout keeps its mask).  :func:`saved_node_name` strips it.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch.fx import Node


@dataclass(frozen=True)
class OpCost:
    """Cost of one fx node; see the module docstring for the conventions.

    ``saved`` names the node whose value autograd keeps (through views, the node
    owning the storage), so summing over a layer deduplicated by name counts each
    tensor once.  A kept tensor that is no node's value is named
    ``"<node>:<what>"`` (``"drop:mask"``); ``saved_node_name`` gives the node."""

    # "matmul" | "attention" | "norm" | "elementwise" | "embedding" | "loss" | "view" | "comm"
    op_class: str
    fwd_flops: float
    bwd_flops: float  # input-grad + weight-grad flops
    fwd_bytes: float  # bytes read + written by the forward kernel(s)
    bwd_bytes: float
    saved: tuple[tuple[str, float], ...]  # (node kept for backward, bytes)
    matmul_flops: float = 0  # part of fwd_flops done in matmuls/attention
    pairs: float = 0  # fused attention: (batch x head) pairs, each a run of score tiles
    # Ops a CPU runs element by element, far from what their FLOPs and bytes say, priced per
    # element when the profile measured the rate (Cluster.element_s): "layer_norm",
    # "rms_norm", or "strided" (a pointwise op or copy over a non-contiguous tensor, which
    # misses the vectorised contiguous loop); "" for the rest.
    per_element: str = ""
    elements: float = 0  # the output's elements, for per_element
    # A matmul's shape (m, n, k, groups) at the captured batch, m the rows (which follow the
    # micro-batch) summed over `groups` equal GEMMs (the experts of a MoE layer; 1 otherwise):
    # cost_model.hardware.compute prices its tile and wave quantisation. () for other ops.
    gemm: tuple = ()


ZERO = OpCost("view", 0.0, 0.0, 0.0, 0.0, ())
SUFFIX_SEP = ":"
BWD_FACTOR = 2.0  # backward/forward flops for everything but attention
SDPA_BWD_FACTOR = 2.5  # fused attention recomputes the scores in backward
KIND_BUDGET = 32  # nodes a parameter/constant walk may visit before assuming "activation"


def saved_node_name(saved_name: str) -> str:
    """The fx node a saved entry belongs to (drops a ``:mask``-style suffix)."""
    return saved_name.split(SUFFIX_SEP, 1)[0]


# ---------------------------------------------------------------- tensor facts


def tensors_in(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in tensors_in(v)]
    return []


def value(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, Node) else x


def tensor_of(x: Any) -> torch.Tensor | None:
    """The single tensor value of ``x`` (a node or a tensor), else None."""
    ts = tensors_in(value(x))
    return ts[0] if len(ts) == 1 else None


def numel(t: torch.Tensor) -> float:
    return float(t.numel())


def nbytes(t: torch.Tensor | None) -> float:
    return 0.0 if t is None else float(t.numel()) * t.element_size()


def total_bytes(val: Any) -> float:
    return sum(nbytes(t) for t in tensors_in(val))


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# ---------------------------------------------------------------- op names

# Spellings of one op across torch, torch.nn.functional, Tensor methods,
# operator and aten overloads, mapped to one rule name.
ALIASES = {
    "_softmax": "softmax", "_safe_softmax": "softmax", "_log_softmax": "log_softmax",
    "_unsafe_view": "view",
    "native_layer_norm": "layer_norm", "native_dropout": "dropout",
    "_fused_rms_norm": "rms_norm", "cross_entropy_loss": "cross_entropy",
    "nll_loss_forward": "nll_loss", "nll_loss_nd": "nll_loss",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_cudnn_attention": "scaled_dot_product_attention",
    "truediv": "div", "true_divide": "div", "divide": "div", "multiply": "mul",
    "subtract": "sub", "floordiv": "floor_divide", "mod": "remainder",
    "and_": "bitwise_and", "or_": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not",
    "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
    "__invert__": "bitwise_not",
    "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "div",
    "concat": "cat", "concatenate": "cat", "constant_pad_nd": "pad", "absolute": "abs",
    "clip": "clamp", "swapaxes": "transpose", "swapdims": "transpose", "moveaxis": "movedim",
}
_PY_MODULES = frozenset({"_operator", "operator", "math", "builtins"})


def op_name(node: Node) -> str | None:
    """Rule name of a call_function/call_method node; None if not a torch op."""
    target = node.target
    if node.op == "call_method":
        raw = target
    elif node.op != "call_function":
        return None
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if str(target).split(".")[0] != "aten":  # "aten.mm.default" or "aten.mm"
            return None
        raw = getattr(target, "overloadpacket", target).__name__
    else:
        # User functions kept as calls (torch.fx.wrap) must not be priced as a
        # torch op that happens to share their name.
        module = getattr(target, "__module__", None) or ""
        if not (module.startswith("torch") or module in _PY_MODULES):
            return None
        raw = getattr(target, "__name__", None)
    if not isinstance(raw, str):
        return None
    if raw in ALIASES:
        return ALIASES[raw]
    if raw.endswith("_") and not raw.endswith("__"):  # in-place variant: same cost
        raw = raw[:-1]
    return ALIASES.get(raw, raw)


@dataclass(frozen=True)
class Call:
    """A node being priced: its rule name, the graph's modules and, for call_module, its module."""

    node: Node
    name: str
    modules: Mapping[str, torch.nn.Module]
    module: torch.nn.Module | None = None

    def arg(self, pos: int, names: str | tuple[str, ...], default: Any = None) -> Any:
        """Argument by keyword name, else by position.

        aten overloads are looked up by name in their schema, because the
        positions differ between aten and torch.nn.functional (embedding,
        the attention variants)."""
        names = (names,) if isinstance(names, str) else names
        for name in names:
            if name in self.node.kwargs:
                return self.node.kwargs[name]
        schema = getattr(self.node.target, "_schema", None)
        if schema is not None:
            arg_names = [a.name for a in schema.arguments]
            pos = next((arg_names.index(n) for n in names if n in arg_names), None)
            if pos is None:
                return default
        args = self.node.args
        return args[pos] if pos < len(args) else default


def tensor_args(node: Node) -> list[Node]:
    """Tensor-valued input nodes in argument order, repeats kept (``x * x``)."""
    found: list[Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, Node):
            if tensors_in(value(a)):
                found.append(a)
        elif isinstance(a, (tuple, list)):
            for item in a:
                visit(item)
        elif isinstance(a, dict):
            for item in a.values():
                visit(item)

    visit(node.args)
    visit(node.kwargs)
    return found


def unique(nodes: list[Node]) -> list[Node]:
    return list(dict.fromkeys(nodes))


# ---------------------------------------------------------------- graph facts


def _placeholder_kind(node: Node) -> str:
    # torch.export lifts parameters, buffers and constants to placeholders named
    # p_*, b_*, c_*; lifted parameters also carry requires_grad in their value.
    t = tensor_of(node)
    if node.name.startswith("p_") and t is not None and t.requires_grad:
        return "param"
    if node.name.startswith(("b_", "c_")) and (t is None or not t.requires_grad):
        return "constant"
    return "activation"


def _get_attr_kind(node: Node) -> str:
    # FakeTensorProp drops requires_grad, so ask the owning module for the real attribute.
    owner = node.graph.owning_module
    try:
        attr = functools.reduce(getattr, str(node.target).split("."), owner)
    except AttributeError:
        attr = value(node)
    grad = isinstance(attr, torch.Tensor) and attr.requires_grad
    return "param" if grad else "constant"


def kind(node: Node) -> str:
    """'activation' (depends on a model input), 'param' (only on parameters) or 'constant'.

    Walks tensor inputs back to placeholders/get_attrs.  The walk is bounded:
    constant chains (causal masks, RoPE tables) are short, and a walk that runs
    out of budget is an activation — the conservative answer for memory."""
    seen: set[Node] = set()
    stack, has_param = [node], False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > KIND_BUDGET:
            return "activation"
        if n.op == "placeholder":
            k = _placeholder_kind(n)
            if k == "activation":
                return k
            has_param |= k == "param"
        elif n.op == "get_attr":
            has_param |= _get_attr_kind(n) == "param"
        else:
            stack.extend(a for a in n.all_input_nodes if tensors_in(value(a)))
    return "param" if has_param else "constant"


def requires_grad(x: Any) -> bool:
    t = tensor_of(x)
    return isinstance(x, Node) and t is not None and is_float(t) and kind(x) != "constant"


def dropout_active(call: Call) -> bool:
    if call.module is not None:
        return call.module.training and call.module.p > 0
    p = call.arg(1, "p", 0.5)
    train = call.arg(2, ("training", "train"), True)
    return (train is None or bool(train)) and p > 0


ALWAYS_VIEWS = frozenset({
    "view", "transpose", "t", "permute", "unsqueeze", "squeeze", "view_as", "alias",
    "detach", "expand", "expand_as", "unflatten", "movedim", "narrow", "select", "slice",
    "as_strided", "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "identity",
    "mT", "mH", "numpy_T", "adjoint", "matrix_H", "unfold", "real", "imag", "broadcast_to",
    "broadcast_tensors",
})
VIEWS_IF_CONTIGUOUS = frozenset({"reshape", "reshape_as", "flatten", "contiguous"})
CASTS = frozenset({"to", "type_as", "float", "half", "bfloat16", "double", "type", "_to_copy",
                   "int", "long", "short", "bool", "byte", "char"})


def alias_source(node: Node, modules: Mapping[str, torch.nn.Module]) -> Node | None:
    """The input whose storage ``node`` only re-views (same bytes), else None."""
    src = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    t_out, t_in = tensor_of(node), tensor_of(src)
    if t_out is None or t_in is None or nbytes(t_out) != nbytes(t_in):
        return None
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if isinstance(mod, torch.nn.Identity):
            return src
        inactive = isinstance(mod, torch.nn.Dropout) and not dropout_active(
            Call(node, "dropout", modules, mod))
        return src if inactive else None
    name = op_name(node)
    if name == "getitem":
        return src if not tensor_args(node)[1:] else None  # tensor index = gather copy
    if name in ALWAYS_VIEWS or name == "getattr":  # x.T, x.mT
        return src
    if name in VIEWS_IF_CONTIGUOUS:
        return src if t_in.is_contiguous() else None
    if name in CASTS:
        return src if name != "_to_copy" and t_in.dtype == t_out.dtype else None
    if name == "dropout" and not dropout_active(Call(node, name, modules)):
        return src
    return None


def alias_root(node: Node, modules: Mapping[str, torch.nn.Module]) -> Node:
    while (src := alias_source(node, modules)) is not None:
        node = src
    return node


def keep(x: Any, modules: Mapping[str, torch.nn.Module]) -> tuple[tuple[str, float], ...]:
    """Saved entry for input ``x``: nothing unless it is an activation tensor."""
    t = tensor_of(x)
    if not isinstance(x, Node) or t is None or kind(x) != "activation":
        return ()
    return ((alias_root(x, modules).name, nbytes(t)),)


def output_ref(node: Node) -> str:
    """Name of the node holding this op's (first) output: the getitem of a tuple op."""
    if isinstance(value(node), torch.Tensor):
        return node.name
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == 0:
            return user.name
    return node.name


def out_tensor(node: Node) -> torch.Tensor:
    return tensors_in(value(node))[0]


def finish(op_class: str, fwd_flops: float, bwd_flops: float, fwd_bytes: float,
           bwd_bytes: float, saved: Iterator | tuple = (), matmul: float = 0.0) -> OpCost:
    """Build an OpCost, keeping the first entry of each saved name (``x * x`` keeps x once)."""
    kept: dict[str, float] = {}
    for name, size in saved:
        kept.setdefault(name, float(size))
    return OpCost(op_class, float(fwd_flops), float(bwd_flops), float(fwd_bytes),
                  float(bwd_bytes), tuple(kept.items()), float(matmul))


def saved_bytes(saved: tuple) -> float:
    return sum(size for _, size in saved)


def grad_io_bytes(node: Node, inputs: list) -> float:
    """Backward traffic besides saved tensors: read the output grad, write input grads."""
    grads = sum(nbytes(tensor_of(i)) for i in unique(inputs) if requires_grad(i))
    return nbytes(out_tensor(node)) + grads


def param(call: Call, pos: int, name: str) -> torch.Tensor | None:
    """A weight/bias: the module's own for call_module, else the argument's value."""
    if call.module is not None:
        return getattr(call.module, name, None)
    return tensor_of(call.arg(pos, name))
