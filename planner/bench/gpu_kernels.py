"""What a GPU's fused kernels keep for backward, for a dry run on a CPU (planner.bench.dry_run).

A dry run runs the rank programs on the planning machine's kernels. Where the CPU composes an op
that CUDA runs fused, the two keep different tensors for backward, and a plan for GPUs must be
checked against what CUDA keeps. One op differs where it matters: `F.rms_norm` (nn.RMSNorm) on
16-bit inputs. Its CPU path upcasts to fp32 and autograd keeps the fp32 input, the normalised
fp32 tensor and their product (three fp32 copies of the input); CUDA's fused kernel
(aten._fused_rms_norm, PyTorch 2.8 and later) keeps the input and one fp32 rstd per row. Under
`fused_norms()` F.rms_norm is a function that keeps what the fused kernel keeps, with the
gradients of RMSNorm (computed in fp32); on fake tensors its backward allocates what the fused
backward does, dx and dw, where the composed one holds six fp32 copies of the input for a
moment (a GPU plan's dry run would count them: 0.65 GiB on Llama 2 7B's shape at tp=2). Norms
written out op by op (Hugging Face's LlamaRMSNorm, with its own .float()) keep their fp32
tensors on either device and are untouched.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

_COMPOSED_RMS_NORM = F.rms_norm


class _FusedRMSNorm(torch.autograd.Function):
    """y = x · rstd · w, rstd = (mean(x²) + eps)^-½ over the normalised dims; keeps x and rstd."""

    @staticmethod
    def forward(ctx, x, weight, dims: int, eps: float):
        wide = x.float()
        rstd = torch.rsqrt(wide.pow(2).mean(dim=tuple(range(-dims, 0)), keepdim=True) + eps)
        y = wide * rstd
        y = (y * weight.float() if weight is not None else y).to(x.dtype)
        ctx.save_for_backward(x, rstd, weight)
        ctx.dims = dims
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        if isinstance(x, FakeTensor):   # a dry run: what the fused backward allocates, dx and
            return (torch.empty_like(x),  # dw, where the composed one below holds six fp32
                    torch.empty_like(weight) if weight is not None else None,  # copies of x
                    None, None)
        dims = tuple(range(-ctx.dims, 0))
        wide, g = x.float(), grad.float()
        normed = wide * rstd
        gw = g * weight.float() if weight is not None else g
        dx = rstd * (gw - normed * (gw * normed).mean(dim=dims, keepdim=True))
        dw = None
        if weight is not None:
            lead = tuple(range(g.dim() - ctx.dims))
            dw = (g * normed).sum(dim=lead).to(weight.dtype)
        return dx.to(x.dtype), dw, None, None


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """F.rms_norm keeping, on 16-bit inputs, what CUDA's fused kernel keeps."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return _COMPOSED_RMS_NORM(x, normalized_shape, weight, eps)
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    return _FusedRMSNorm.apply(x, weight, len(normalized_shape), eps)


class _FusedAttention(torch.autograd.Function):
    """On fake tensors, attention with dropout as CUDA's fused kernels run it (flash and
    memory-efficient attention draw the dropout from a seed inside the kernel): they keep the
    inputs, the output and one fp32 logsumexp per query row, and make q's, k's and v's gradients
    (and a trained bias's, T5's relative positions). The CPU has no fused kernel with dropout
    and runs the math path, which keeps the [batch, heads, seq, seq] weights, their fp32
    softmax and the dropout mask: 0.35 GiB per attention of Flan-T5-XL at 1024 tokens."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _, mask = ctx.saved_tensors
        bias = torch.empty_like(mask) if mask is not None and ctx.needs_input_grad[3] else None
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), bias


_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p")


class _FusedAttentionMode(TorchFunctionMode):
    """Attention with dropout on the dry run's fake tensors (`fake_mode`'s: not those of a
    capture tracing the model) runs as `_FusedAttention`; all else as it is."""

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA:
            given = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
            query = given["query"]
            if given.get("dropout_p", 0.0) > 0 and isinstance(query, FakeTensor) and \
                    query.fake_mode is self.fake_mode:
                return _FusedAttention.apply(given["query"], given["key"], given["value"],
                                             given.get("attn_mask"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def fused_norms(fake_mode=None):
    """F.rms_norm as the fused kernel keeps it, and on `fake_mode`'s tensors attention with
    dropout as the fused kernels keep it (see the module docstring)."""
    with mock.patch.object(F, "rms_norm", rms_norm), _FusedAttentionMode(fake_mode):
        yield
