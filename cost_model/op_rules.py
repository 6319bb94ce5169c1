"""Per-operation cost rules: FLOPs, bytes moved and tensors kept for backward.

Every rule reads shapes and dtypes from ``node.meta["val"]`` (FakeTensorProp or
torch.export output) and returns an :class:`OpCost`.  ``cost_model.ops`` maps fx
nodes to these rules; this module holds the rules and the graph facts they need.

Conventions, and why:

* Matmul FLOPs follow Narayanan et al. 2021: forward ``2*M*N*K`` (times the batch),
  backward twice the forward (input grad + weight grad).  The 2x is kept even for a
  frozen weight: training graphs rarely freeze one and the planner wants an upper
  bound.  Bias adds of linear/addmm are not counted, so the figure is exactly 2MNK.
* Saved bytes follow Korthikanti et al. 2022 (``sbh(34 + 5as/h)`` per GPT layer):
  each rule names the node whose value autograd keeps, walked back through pure
  views to the node that owns the storage, so a tensor kept by two ops (or through
  two views) dedups to one name.  Parameters, buffers and constants are never
  counted: they live for the whole step anyway.
* A kept tensor that is no node's value (dropout mask, attention log-sum-exp,
  cross-entropy log-softmax) is named ``"<node>:<what>"``; the suffix keeps it from
  deduping against the node's own output (``att @ v`` keeps the dropout output
  *and* the dropout keeps its mask).  :func:`saved_node_name` strips it.
* Non-matmul ops cost a few FLOPs per element (constants below) and backward is
  2x forward.  These ops are memory-bound, so the bytes matter, not the FLOPs:
  forward reads inputs and writes outputs; backward reads the output grad and the
  saved tensors and writes the input grads.
"""

from __future__ import annotations

import functools
import math
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
    "mT", "mH", "numpy_T", "adjoint", "matrix_H",
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



def _param(call: Call, pos: int, name: str) -> torch.Tensor | None:
    """A weight/bias: the module's own for call_module, else the argument's value."""
    if call.module is not None:
        return getattr(call.module, name, None)
    return tensor_of(call.arg(pos, name))


# ---------------------------------------------------------------- matmul family


def linear(call: Call) -> OpCost:
    x = call.arg(0, "input")
    weight, bias = _param(call, 1, "weight"), _param(call, 2, "bias")
    out = out_tensor(call.node)
    flops = 2 * numel(out) * tensor_of(x).shape[-1]
    fwd_bytes = nbytes(tensor_of(x)) + nbytes(weight) + nbytes(bias) + nbytes(out)
    # Both grad matmuls move the same operand sizes as the forward one.
    return finish("matmul", flops, BWD_FACTOR * flops, fwd_bytes, BWD_FACTOR * fwd_bytes,
                  keep(x, call.modules), flops)


_BIASED = frozenset({"addmm", "baddbmm"})  # (bias, a, b); the others are (a, b)


def matmul(call: Call) -> OpCost:
    operands = tensor_args(call.node)
    bias, a, b = operands[:3] if call.name in _BIASED else (None, *operands[:2])
    ta, tb, out = tensor_of(a), tensor_of(b), out_tensor(call.node)
    flops = 2 * numel(out) * ta.shape[-1]  # = 2*M*N*K, batch dims included in numel(out)
    fwd_bytes = nbytes(ta) + nbytes(tb) + nbytes(tensor_of(bias)) + nbytes(out)
    return _matmul_cost(call, a, b, flops, fwd_bytes)


def _matmul_cost(call: Call, a: Node, b: Node, flops: float, fwd_bytes: float) -> OpCost:
    # Each operand is kept only for the other operand's grad.
    saved = (keep(a, call.modules) if requires_grad(b) else ()) + (
        keep(b, call.modules) if requires_grad(a) else ())
    # Both grad matmuls move the same operand sizes as the forward one.
    return finish("matmul", flops, BWD_FACTOR * flops, fwd_bytes, BWD_FACTOR * fwd_bytes,
                  saved, flops)


def _letter_sizes(spec: str, shape: torch.Size) -> dict[str, int]:
    head, _, tail = spec.partition("...")
    sizes = dict(zip(head, shape))
    if tail:
        sizes.update(zip(tail, shape[len(shape) - len(tail):]))
    return sizes


def einsum(call: Call) -> OpCost | None:
    """Two-operand einsum: 2 x output elements x product of the contracted sizes."""
    equation, *operands = call.node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = equation.replace(" ", "")
    if len(operands) != 2 or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    sizes: dict[str, int] = {}
    for spec, node in zip(inputs.split(","), operands):
        sizes.update(_letter_sizes(spec, tensor_of(node).shape))
    contracted = math.prod(n for letter, n in sizes.items() if letter not in output)
    a, b = operands
    out = out_tensor(call.node)
    flops = 2 * numel(out) * contracted
    fwd_bytes = nbytes(tensor_of(a)) + nbytes(tensor_of(b)) + nbytes(out)
    return _matmul_cost(call, a, b, flops, fwd_bytes)


def attention(call: Call) -> OpCost:
    """scaled_dot_product_attention, fused: scores never reach memory.

    FLOPs count QK^T and PV by their real shapes (so GQA's smaller k/v heads do
    not change them), halved for is_causal; backward is 2.5x (flash recomputes
    the scores).  Kept: q, k, v, the output and an fp32 log-sum-exp per query row;
    with dropout_p > 0 the fused kernels keep an RNG seed, not a mask: nothing more."""
    node = call.node
    q, k, v = call.arg(0, "query"), call.arg(1, "key"), call.arg(2, "value")
    mask = call.arg(3, ("attn_mask", "attn_bias"))
    tq, tk, tv, out = tensor_of(q), tensor_of(k), tensor_of(v), out_tensor(node)
    rows = numel(tq) / tq.shape[-1]  # batch x query heads x query length
    flops = 2 * rows * tk.shape[-2] * (tq.shape[-1] + tv.shape[-1])
    if call.arg(5, "is_causal", False):
        flops /= 2  # the masked upper triangle is skipped
    lse = rows * 4
    saved = (keep(q, call.modules) + keep(k, call.modules) + keep(v, call.modules)
             + keep(mask, call.modules)
             + ((output_ref(node), nbytes(out)), (f"{node.name}{SUFFIX_SEP}logsumexp", lse)))
    fwd_bytes = nbytes(tq) + nbytes(tk) + nbytes(tv) + nbytes(tensor_of(mask)) + nbytes(out) + lse
    bwd_bytes = grad_io_bytes(node, [q, k, v]) + saved_bytes(saved)
    return finish("attention", flops, SDPA_BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved, flops)


# ---------------------------------------------------------------- norms, dropout, embedding, loss

# layer_norm: mean, subtract, square, sum, scale by rstd, weight, bias.
# rms_norm: square, sum, scale by rstd, weight.
NORM_FLOPS = {"layer_norm": 7.0, "rms_norm": 4.0}


def norm(call: Call) -> OpCost:
    """Keeps its input only; the per-row mean/rstd (fp32, hidden-size times smaller)
    are ignored, as in Korthikanti et al."""
    x = call.arg(0, "input")
    bias = _param(call, 3, "bias") if call.name == "layer_norm" else None
    param_bytes = nbytes(_param(call, 2, "weight")) + nbytes(bias)
    tx, out = tensor_of(x), out_tensor(call.node)
    flops = NORM_FLOPS[call.name] * numel(tx)
    saved = keep(x, call.modules)
    # Backward also reads the weights and writes their grads.
    bwd_bytes = grad_io_bytes(call.node, [x]) + saved_bytes(saved) + 2 * param_bytes
    return finish("norm", flops, BWD_FACTOR * flops, nbytes(tx) + nbytes(out) + param_bytes,
                  bwd_bytes, saved)


def dropout(call: Call) -> OpCost:
    """Active dropout keeps a 1-byte mask per element (Korthikanti's accounting),
    named ``<node>:mask``; inactive dropout returns its input unchanged."""
    if not dropout_active(call):
        return ZERO
    x = call.arg(0, "input")
    tx, out = tensor_of(x), out_tensor(call.node)
    mask = numel(tx)
    saved = ((f"{call.node.name}{SUFFIX_SEP}mask", mask),)
    flops = 2 * numel(tx)  # compare a random draw, scale
    bwd_bytes = grad_io_bytes(call.node, [x]) + mask
    return finish("elementwise", flops, BWD_FACTOR * flops, nbytes(tx) + nbytes(out) + mask,
                  bwd_bytes, saved)


def embedding(call: Call) -> OpCost:
    """A gather: no FLOPs; reads the selected rows and writes them.  Backward
    scatter-adds into a dense weight grad, so it writes the whole table."""
    indices = call.arg(0, ("indices", "input"))  # aten: (weight, indices); F: (input, weight)
    weight, out = _param(call, 1, "weight"), out_tensor(call.node)
    idx_bytes = nbytes(tensor_of(indices))
    fwd_bytes = 2 * nbytes(out) + idx_bytes
    bwd_bytes = nbytes(out) + idx_bytes + nbytes(weight)
    return finish("embedding", 0, numel(out), fwd_bytes, bwd_bytes, keep(indices, call.modules))


LOSS_FLOPS = 5.0  # log-softmax per logit: max, subtract, exp, sum, log


def cross_entropy(call: Call) -> OpCost:
    """Keeps a logits-sized log-softmax (``<node>:log_softmax``) and the targets."""
    logits, target = call.arg(0, ("input", "self")), call.arg(1, "target")
    tl, tt = tensor_of(logits), tensor_of(target)
    logit_bytes = nbytes(tl)
    log_softmax = f"{call.node.name}{SUFFIX_SEP}log_softmax"
    saved = ((log_softmax, logit_bytes),) + keep(target, call.modules)
    flops = LOSS_FLOPS * numel(tl)
    fwd_bytes = 2 * logit_bytes + nbytes(tt) + total_bytes(value(call.node))
    bwd_bytes = 2 * logit_bytes + nbytes(tt)  # read the log-softmax, write the logits grad
    return finish("loss", flops, BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved)


def nll_loss(call: Call) -> OpCost:
    """Gathers one log-probability per target; backward writes a dense grad."""
    logp, target = call.arg(0, ("input", "self")), call.arg(1, "target")
    tl, tt = tensor_of(logp), tensor_of(target)
    rows = numel(tt)
    fwd_bytes = rows * tl.element_size() + nbytes(tt) + total_bytes(value(call.node))
    return finish("loss", rows, BWD_FACTOR * rows, fwd_bytes, nbytes(tl) + nbytes(tt),
                  keep(target, call.modules))


# ---------------------------------------------------------------- pointwise

# Rule name -> (flops per element, what autograd keeps):
#   none     nothing (add, reductions to a sum, data movement)
#   input    the first tensor input       output   the op's own output
#   operands each activation operand whose partner needs a grad (mul, div)
#   index    integer/bool tensor inputs: masks, indices, conditions (often buffers)
POINTWISE: dict[str, tuple[float, str]] = {}
NON_DIFFERENTIABLE: set[str] = set()


def _table(names: str, flops: float, policy: str, differentiable: bool = True) -> None:
    for name in names.split():
        POINTWISE[name] = (flops, policy)
        if not differentiable:
            NON_DIFFERENTIABLE.add(name)


_table("add sub rsub neg sum mean cumsum remainder", 1, "none")
_table("cat stack pad flip roll repeat repeat_interleave tile copy fill zero", 0, "none")
_table("mul div maximum minimum outer atan2", 1, "operands")
_table("pow square abs clamp clamp_min clamp_max hardtanh leaky_relu amax amin max min"
       " var std norm linalg_vector_norm prod", 1, "input")
_table("log log1p log2 sin cos erf softplus mish elu logsumexp", 4, "input")
_table("exp exp2 tanh sigmoid sqrt rsqrt reciprocal", 4, "output")
_table("relu", 1, "output")
_table("silu", 4, "input")  # sigmoid + multiply
_table("gelu", 8, "input")  # tanh form: cube, fma, tanh, add, multiply
_table("softmax log_softmax", 5, "output")  # max, subtract, exp, sum, divide
_table("masked_fill where tril triu index_fill scatter scatter_add index_add", 1, "index")
_table("gather index_select take_along_dim", 0, "index")
_table("eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and"
       " bitwise_or bitwise_xor bitwise_not isinf isnan isfinite sign floor ceil round trunc"
       " floor_divide argmax argmin any all", 1, "none", differentiable=False)
_table("arange ones zeros full empty ones_like zeros_like full_like empty_like scalar_tensor"
       " rand randn rand_like randn_like randint randint_like bernoulli new_ones new_zeros"
       " new_full new_empty new_tensor eye linspace tensor", 0, "none", differentiable=False)


def _policy_saved(call: Call, policy: str, args: list[Node]) -> tuple:
    keep_ = functools.partial(keep, modules=call.modules)
    if policy == "input":
        return keep_(args[0]) if args else ()
    if policy == "output":
        return ((output_ref(call.node), nbytes(out_tensor(call.node))),)
    if policy == "operands":
        return tuple(entry for i, a in enumerate(args)
                     if any(requires_grad(p) for p in args[:i] + args[i + 1:])
                     for entry in keep_(a))
    if policy == "index":
        return tuple(entry for a in args
                     if (t := tensor_of(a)) is not None and not is_float(t)
                     for entry in keep_(a))
    return ()


def elementwise(call: Call, flops_per_elem: float, policy: str) -> OpCost:
    """A memory-bound op: reads every input in full and writes its outputs."""
    node = call.node
    args = tensor_args(node)
    ins = unique(args)
    in_ts = [t for i in ins for t in tensors_in(value(i))]
    outs = tensors_in(value(node))
    flops = flops_per_elem * max((numel(t) for t in in_ts + outs), default=0)
    fwd_bytes = sum(nbytes(t) for t in in_ts + outs)
    differentiable = (call.name not in NON_DIFFERENTIABLE and outs and is_float(outs[0])
                      and any(requires_grad(i) for i in ins))
    if not differentiable:  # no backward, so autograd keeps nothing either
        return finish("elementwise", flops, 0, fwd_bytes, 0)
    saved = _policy_saved(call, policy, args)
    bwd_bytes = grad_io_bytes(node, ins) + saved_bytes(saved)
    return finish("elementwise", flops, BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved)


def pointwise(call: Call) -> OpCost:
    return elementwise(call, *POINTWISE[call.name])


# ---------------------------------------------------------------- views, copies, casts

COPIES = frozenset({"clone", "lift_fresh_copy"})


def view(call: Call) -> OpCost:
    """Layout ops alias their input: no kernel, nothing kept.  The exceptions copy:
    clone always, contiguous/reshape/flatten of a strided tensor, and indexing with
    a tensor (a gather).  A copy's backward passes the grad through, so it is free."""
    node = call.node
    if call.name == "getitem" and tensor_args(node)[1:]:
        return elementwise(call, 0, "index")
    if call.name in COPIES or (call.name in VIEWS_IF_CONTIGUOUS
                               and alias_source(node, call.modules) is None):
        size = total_bytes(value(node))
        return finish("view", 0, 0, 2 * size, 0)
    return ZERO


def cast(call: Call) -> OpCost:
    """``to``/``float``/...: free when the dtype does not change, else a copy."""
    if alias_source(call.node, call.modules) is not None:
        return ZERO
    return elementwise(call, 0, "none")
