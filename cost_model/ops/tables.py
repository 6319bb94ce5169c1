"""Cost rules by table: pointwise ops (a few FLOPs per element, backward 2x forward),
views, copies and casts.  These ops are memory-bound, so the bytes matter, not the
FLOPs: forward reads inputs and writes outputs; backward reads the output grad and
the saved tensors and writes the input grads.  Shared graph facts and OpCost live in
``cost_model.ops.graph_facts``.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from torch.fx import Node

from cost_model.ops.graph_facts import (BWD_FACTOR, VIEWS_IF_CONTIGUOUS, ZERO, Call, OpCost,
                                 alias_source, finish, grad_io_bytes, is_float, keep, nbytes,
                                 numel, out_tensor, output_ref, requires_grad, saved_bytes,
                                 tensor_args, tensor_of, tensors_in, total_bytes, unique, value)

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
_table("mul div maximum minimum outer atan2 polar complex", 1, "operands")
_table("pow square abs clamp clamp_min clamp_max hardtanh leaky_relu amax amin max min"
       " var std norm linalg_vector_norm prod", 1, "input")
_table("log log1p log2 log10 sin cos tan asin acos atan sinh cosh asinh acosh atanh erf erfinv"
       " softplus mish elu celu selu logsumexp logaddexp expm1 logit hardsigmoid hardswish glu", 4,
       "input")
_table("exp exp2 tanh sigmoid sqrt rsqrt reciprocal", 4, "output")
_table("relu", 1, "output")
_table("silu", 4, "input")  # sigmoid + multiply
_table("gelu", 8, "input")  # tanh form: cube, fma, tanh, add, multiply
_table("softmax log_softmax", 5, "output")  # max, subtract, exp, sum, divide
_table("masked_fill masked_scatter where tril triu index_fill scatter scatter_add index_add", 1,
       "index")
_table("gather index_select take_along_dim index", 0, "index")
# pooling (a vision projector pooling patches into fewer image tokens): one add per input
# element; average pooling's backward needs only the shapes, max pooling's its chosen indices
_table("avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d"
       " adaptive_avg_pool3d", 1, "none")
_table("max_pool1d max_pool2d max_pool3d adaptive_max_pool1d adaptive_max_pool2d", 1, "output")
# Fourier transforms (FNet's token mixing): ~5 log2(n) FLOPs per element, n the transformed
# length (Cooley-Tukey), taken at n ~ 1-4K: 55; linear, so backward needs no saved input
_table("fft_fft fft_ifft fft_rfft fft_irfft fft_hfft fft_ihfft fft_fft2 fft_ifft2 fft_rfft2"
       " fft_irfft2 fft_fftn fft_ifftn fft_rfftn fft_irfftn _fft_c2c _fft_r2c _fft_c2r", 55, "none")
_table("eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and"
       " bitwise_or bitwise_xor bitwise_not isinf isneginf isposinf isnan isfinite sign floor ceil"
       " round trunc floor_divide argmax argmin any all", 1, "none", differentiable=False)
# Selection and counting (routers, sampling masks): sort-like ops keep the indices they chose
# (about the size of their first output) for backward; counting and searching has no backward.
_table("topk sort msort kthvalue median mode cummax cummin", 4, "output")
_table("histc bincount argsort searchsorted bucketize nonzero unique count_nonzero", 1, "none",
       differentiable=False)
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
        cost = finish("elementwise", flops, 0, fwd_bytes, 0)
    else:
        saved = _policy_saved(call, policy, args)
        bwd_bytes = grad_io_bytes(node, ins) + saved_bytes(saved)
        cost = finish("elementwise", flops, BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved)
    return _strided(cost, in_ts, outs)


def _strided(cost: OpCost, ins: list, outs: list) -> OpCost:
    """`cost`, priced per element (OpCost.per_element "strided") when it reads a non-contiguous
    floating tensor in full: a transposed or sliced operand (rotary's halves of a head, a
    head-major view) runs element by element, several times slower than the vectorised
    contiguous loop its bytes price. Broadcast operands (smaller, or stride 0) do not count."""
    elements = max((numel(t) for t in outs), default=0)
    if any(is_float(t) and not t.is_contiguous() and numel(t) == elements and 0 not in t.stride()
           for t in ins):
        return replace(cost, per_element="strided", elements=elements)
    return cost


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
        return _strided(finish("elementwise", 0, 0, 2 * size, 0),
                        [t for a in tensor_args(node) for t in tensors_in(value(a))],
                        tensors_in(value(node)))
    return ZERO


def cast(call: Call) -> OpCost:
    """``to``/``float``/...: free when the dtype does not change, else a copy."""
    if alias_source(call.node, call.modules) is not None:
        return ZERO
    return elementwise(call, 0, "none")
