"""Causal attention with attention sinks as one custom op, `torch.ops.fxpar.sink_attention`, so
that a captured GPT-OSS keeps its attention one fused node (priced as fused attention by
cost_model.ops.rules.sink_attention) instead of its [b, heads, s, s + 1] scores written out.

    sink_attention(q [b, H, s, d], k [b, K, s, d], v [b, K, s, e], sinks [H], scaling,
                   window) -> [b, H, s, e]

H is a multiple of K; query head h reads kv head h // (H / K) (transformers' repeat_kv). Query
i of head h sees key j when

    j <= i  and  (window == 0  or  j > i - window)

(transformers' causal_mask_function and sliding_window_overlay: a window of `window` keys,
the query's own included). Over the visible keys and one extra "sink" logit per head,

    z_j = scaling * q_i . k_j,   z_sink = sinks[h]
    p_j = exp(z_j) / (exp(z_sink) + sum_j' exp(z_j'))        (the sink takes part, then is dropped)
    out_i = sum_j p_j v_j

which is transformers' gpt_oss eager_attention_forward under its causal / sliding masks, step for
step and in the same dtypes (the masked scores filled with the dtype's minimum, as its additive
mask makes them, the row maximum subtracted, softmax in the scores' dtype, the probabilities cast
to v's dtype). The only difference is the order of the sums: the op runs by blocks of query
rows, each against only the keys it can see, so the scores in memory at once are one block's
(rows x (rows + window - 1) with a window, rows x at most s without), not s x s, and a sliding
layer does about s x (rows + window) work, not s x s.
The backward recomputes each block under autograd and differentiates it (as activation
checkpointing does), keeping only the inputs for backward.
"""
from __future__ import annotations

import torch

ROWS = 512          # query rows per block of a causal attention without a window
WINDOW_ROWS = 128   # with a window, rows per block at least (a block sees rows + window - 1 keys)


def visible(rows: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """[len(rows), len(keys)] boolean: query position i sees key position j (module docstring)."""
    seen = keys[None, :] <= rows[:, None]
    if window:
        seen = seen & (keys[None, :] > rows[:, None] - window)
    return seen


def blocks(seq: int, window: int, rows: int | None = None):
    """(query slice, key slice) per block of `rows` query rows: the keys any row of the block
    sees, from the first row's window start (0 without a window) to the last row."""
    rows = rows or (max(window, WINDOW_ROWS) if window else ROWS)
    for start in range(0, seq, rows):
        stop = min(start + rows, seq)
        first = max(0, start - window + 1) if window else 0
        yield slice(start, stop), slice(first, stop)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' repeat_kv: kv head j serves query heads j * groups .. (j + 1) * groups - 1."""
    if groups == 1:
        return x
    b, heads, n, d = x.shape
    return x[:, :, None].expand(b, heads, groups, n, d).reshape(b, heads * groups, n, d)


def _block(q, k, v, sinks, scaling: float, rows: slice, keys: slice, window: int):
    """The output rows `rows` of q (q, k, v already cut to the block's rows and keys)."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat(k, groups), _repeat(v, groups)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    seen = visible(torch.arange(rows.start, rows.stop, device=q.device),
                   torch.arange(keys.start, keys.stop, device=q.device), window)
    # eager adds finfo.min to the masked scores; filling with it gives the same probabilities (0)
    scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _check(q, k, v, sinks, window: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"sink_attention takes q, k, v as [batch, heads, seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"sink_attention: {q.shape[1]} query heads do not group over "
                         f"{k.shape[1]} key / {v.shape[1]} value heads")
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(f"sink_attention attends a sequence to itself: {q.shape[2]} queries, "
                         f"{k.shape[2]} keys, {v.shape[2]} values")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sink_attention: sinks {tuple(sinks.shape)}, not one per query head "
                         f"({q.shape[1]})")
    if window < 0:
        raise ValueError(f"sink_attention: window {window} (0: none)")


def attend(q, k, v, sinks, scaling: float, window: int = 0, rows: int | None = None):
    """The op's value (see the module docstring), by blocks of `rows` query rows."""
    _check(q, k, v, sinks, window)
    parts = [_block(q[:, :, r], k[:, :, c], v[:, :, c], sinks, scaling, r, c, window)
             for r, c in blocks(q.shape[2], window, rows)]
    return torch.cat(parts, dim=2)


def attend_backward(grad, q, k, v, sinks, scaling: float, window: int = 0,
                    rows: int | None = None):
    """Gradients of `attend` for q, k, v, sinks: each block recomputed under autograd. Key,
    value and sink gradients collect over blocks in float32 at least (a bf16 sum over many
    blocks would round at every step where eager rounds once)."""
    dq, dk, dv, ds = torch.zeros_like(q), _wide(k), _wide(v), _wide(sinks)
    for r, c in blocks(q.shape[2], window, rows):
        leaves = [t.detach().requires_grad_() for t in (q[:, :, r], k[:, :, c], v[:, :, c], sinks)]
        with torch.enable_grad():
            out = _block(*leaves, scaling, r, c, window)
        gq, gk, gv, gs = torch.autograd.grad(out, leaves, grad[:, :, r])
        dq[:, :, r] = gq
        dk[:, :, c] += gk
        dv[:, :, c] += gv
        ds += gs
    return dq, dk.to(k.dtype), dv.to(v.dtype), ds.to(sinks.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Zeros like `t` in float32 at least."""
    return torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)


@torch.library.custom_op("fxpar::sink_attention", mutates_args=())
def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   scaling: float, window: int) -> torch.Tensor:
    return attend(q, k, v, sinks, scaling, window)


@sink_attention.register_fake
def _(q, k, v, sinks, scaling, window):
    _check(q, k, v, sinks, window)
    return q.new_empty((*q.shape[:3], v.shape[-1]), dtype=v.dtype)


def _setup(ctx, inputs, output):
    q, k, v, sinks, scaling, window = inputs
    ctx.save_for_backward(q, k, v, sinks)
    ctx.scaling, ctx.window = scaling, window


def _backward(ctx, grad):
    q, k, v, sinks = ctx.saved_tensors
    grads = attend_backward(grad, q, k, v, sinks, ctx.scaling, ctx.window)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None)


sink_attention.register_autograd(_backward, setup_context=_setup)
