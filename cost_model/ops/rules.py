"""Cost rules of the ops that shape a layer: matmuls, attention, norms, dropout,
embedding and loss.  Pointwise ops, views and casts are priced by table in
``cost_model.ops.tables``; the shared graph facts and OpCost live in
``cost_model.ops.graph_facts`` (which also states how saved tensors are named).

Conventions, and why:

* Matmul FLOPs follow Narayanan et al. 2021: forward ``2*M*N*K`` (times the batch),
  backward twice the forward (input grad + weight grad).  The 2x is kept even for a
  frozen weight: training graphs rarely freeze one and the planner wants an upper
  bound.  Bias adds of linear/addmm are not counted, so the figure is exactly 2MNK.
* Saved bytes follow Korthikanti et al. 2022 (``sbh(34 + 5as/h)`` per GPT layer).
* Other ops here are memory-bound: forward reads inputs and writes outputs; backward
  reads the output grad and the saved tensors and writes the input grads.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.fx import Node

from cost_model.ops.graph_facts import (BWD_FACTOR, SDPA_BWD_FACTOR, SUFFIX_SEP, ZERO, Call, OpCost,
                                 dropout_active, finish, grad_io_bytes, keep, nbytes, numel,
                                 out_tensor, output_ref, param, requires_grad, saved_bytes,
                                 tensor_args, tensor_of, total_bytes, value)

# ---------------------------------------------------------------- matmul family


def linear(call: Call) -> OpCost:
    x = call.arg(0, "input")
    weight, bias = param(call, 1, "weight"), param(call, 2, "bias")
    out = out_tensor(call.node)
    flops = 2 * numel(out) * tensor_of(x).shape[-1]
    fwd_bytes = nbytes(tensor_of(x)) + nbytes(weight) + nbytes(bias) + nbytes(out)
    # Both grad matmuls move the same operand sizes as the forward one.
    cost = finish("matmul", flops, BWD_FACTOR * flops, fwd_bytes, BWD_FACTOR * fwd_bytes,
                  keep(x, call.modules), flops)
    return _with_shape(cost, out, tensor_of(x).shape[-1])


def _with_shape(cost: OpCost, out: torch.Tensor, k: int) -> OpCost:
    """The cost with its GEMM shape: the output's last dimension is n, the rest rows."""
    n = out.shape[-1] if out.dim() else 1
    return replace(cost, gemm=(numel(out) / max(n, 1), float(n), float(k), 1))


_BIASED = frozenset({"addmm", "baddbmm"})  # (bias, a, b); the others are (a, b)


def matmul(call: Call) -> OpCost:
    operands = tensor_args(call.node)
    bias, a, b = operands[:3] if call.name in _BIASED else (None, *operands[:2])
    ta, tb, out = tensor_of(a), tensor_of(b), out_tensor(call.node)
    flops = 2 * numel(out) * ta.shape[-1]  # = 2*M*N*K, batch dims included in numel(out)
    fwd_bytes = nbytes(ta) + nbytes(tb) + nbytes(tensor_of(bias)) + nbytes(out)
    return _with_shape(_matmul_cost(call, a, b, flops, fwd_bytes), out, ta.shape[-1])


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
    cost = finish("attention", flops, SDPA_BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved, flops)
    return replace(cost, pairs=rows / tq.shape[-2])


SINK_ATTENTION = "torch._ops.fxpar.fxpar::sink_attention"   # runtime.attention.sinks (torch.export)


def visible_pairs(seq: int, window: int = 0) -> int:
    """(query, key) pairs a causal attention of `seq` tokens computes when each query sees the
    `window` keys up to and including itself (0: every earlier key): the first w queries see
    1 .. w keys, the other seq - w see w, with w = min(window, seq); s(s + 1)/2 without one."""
    w = min(window, seq) if window else seq
    return w * (w + 1) // 2 + (seq - w) * w


def sink_attention(call: Call) -> OpCost:
    """fxpar.sink_attention(q, k, v, sinks, scaling, window): causal attention with a sink
    logit per head and an optional sliding window, priced as a fused kernel like SDPA (scores
    never reach memory; FlexAttention and TE skip the masked blocks).

    FLOPs count QK^T and PV over the visible (query, key) pairs only (`visible_pairs`, per batch
    row and query head; GQA's k/v heads do not change them); the sink adds one logit per row to
    the softmax, nothing to the matmuls. Backward 2.5x, as SDPA. Moved and kept: q, k, v, the
    sinks, the output and an fp32 log-sum-exp per query row, as flash attention keeps them."""
    node = call.node
    q, k, v = call.arg(0, "q"), call.arg(1, "k"), call.arg(2, "v")
    sinks, window = call.arg(3, "sinks"), int(call.arg(5, "window", 0))
    tq, tk, tv, out = tensor_of(q), tensor_of(k), tensor_of(v), out_tensor(node)
    seq = tq.shape[-2]
    heads = numel(tq) / (seq * tq.shape[-1])  # batch x query heads
    flops = 2 * heads * visible_pairs(seq, window) * (tq.shape[-1] + tv.shape[-1])
    lse = heads * seq * 4
    saved = (keep(q, call.modules) + keep(k, call.modules) + keep(v, call.modules)
             + keep(sinks, call.modules)
             + ((output_ref(node), nbytes(out)), (f"{node.name}{SUFFIX_SEP}logsumexp", lse)))
    fwd_bytes = (nbytes(tq) + nbytes(tk) + nbytes(tv) + nbytes(tensor_of(sinks)) + nbytes(out)
                 + lse)
    bwd_bytes = grad_io_bytes(node, [q, k, v, sinks]) + saved_bytes(saved)
    cost = finish("attention", flops, SDPA_BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved, flops)
    return replace(cost, pairs=heads)


def convolution(call: Call) -> OpCost:
    """conv1d/2d/3d (and aten.convolution): every output element is a dot product over the
    weight's C_in/groups × kernel elements, so FLOPs are 2·numel(out)·numel(w)/C_out, backward
    twice that (input and weight grads), as for a matmul; keeps the input and the weight."""
    x = call.arg(0, "input")
    weight, bias = param(call, 1, "weight"), param(call, 2, "bias")
    tx, out = tensor_of(x), out_tensor(call.node)
    flops = 2 * numel(out) * numel(weight) / max(weight.shape[0], 1)
    fwd_bytes = nbytes(tx) + nbytes(weight) + nbytes(bias) + nbytes(out)
    saved = keep(x, call.modules)  # the weight is a parameter: never counted as saved
    return finish("matmul", flops, BWD_FACTOR * flops, fwd_bytes, BWD_FACTOR * fwd_bytes, saved,
                  flops)


# ---------------------------------------------------------------- norms, dropout, embedding, loss

# layer_norm: mean, subtract, square, sum, scale by rstd, weight, bias.
# rms_norm: square, sum, scale by rstd, weight.
NORM_FLOPS = {"layer_norm": 7.0, "rms_norm": 4.0}


def norm(call: Call) -> OpCost:
    """Keeps its input only; the per-row mean/rstd (fp32, hidden-size times smaller)
    are ignored, as in Korthikanti et al."""
    x = call.arg(0, "input")
    bias = param(call, 3, "bias") if call.name == "layer_norm" else None
    param_bytes = nbytes(param(call, 2, "weight")) + nbytes(bias)
    tx, out = tensor_of(x), out_tensor(call.node)
    flops = NORM_FLOPS[call.name] * numel(tx)
    saved = keep(x, call.modules)
    # Backward also reads the weights and writes their grads.
    bwd_bytes = grad_io_bytes(call.node, [x]) + saved_bytes(saved) + 2 * param_bytes
    cost = finish("norm", flops, BWD_FACTOR * flops, nbytes(tx) + nbytes(out) + param_bytes,
                  bwd_bytes, saved)
    return replace(cost, per_element=call.name, elements=numel(tx))


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
    weight, out = param(call, 1, "weight"), out_tensor(call.node)
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


def vocab_parallel_cross_entropy(call: Call) -> OpCost:
    """A cross-entropy over this rank's logits slice (passes.rewrite.vocab_parallel): as
    cross_entropy, but what it keeps is the probabilities in fp32 at least, as the runtime's
    unfused loss saves them whatever the logits' dtype."""
    cost = cross_entropy(call)
    logits = tensor_of(call.arg(0, ("input", "self")))
    wider = max(4, logits.element_size()) / logits.element_size()
    saved = tuple((name, nbytes * wider if i == 0 else nbytes)
                  for i, (name, nbytes) in enumerate(cost.saved))
    return replace(cost, saved=saved)


def nll_loss(call: Call) -> OpCost:
    """Gathers one log-probability per target; backward writes a dense grad."""
    logp, target = call.arg(0, ("input", "self")), call.arg(1, "target")
    tl, tt = tensor_of(logp), tensor_of(target)
    rows = numel(tt)
    fwd_bytes = rows * tl.element_size() + nbytes(tt) + total_bytes(value(call.node))
    return finish("loss", rows, BWD_FACTOR * rows, fwd_bytes, nbytes(tl) + nbytes(tt),
                  keep(target, call.modules))


# ---------------------------------------------------------------- pointwise
