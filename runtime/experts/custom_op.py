"""The routed experts as one custom op, `torch.ops.fxpar.routed_experts`, so that a model captured
with torch.export (Hugging Face's MoE blocks) keeps them one graph node the expert-parallel
rewrite can cut, as `torch.fx.wrap` keeps `runtime.experts.dispatch.moe_ffn` one node under symbolic
tracing.

    routed_experts(x [T, h], weights [T, k], index [T, k], gate_up [E/ep, 2f, h],
                   down [E/ep, h, f], ep, tag) -> [T, h]

is sum over each token's k slots of weight x down(silu(gate x) * up x), gate and up the two halves
of gate_up (Hugging Face's fused layout), dispatched and combined over the EP group as
runtime.experts.dispatch does (dropless). Its backward runs the forward again under autograd (the experts
are recomputed, as under activation checkpointing; the repeated all-to-all is counted apart, in
RECOMPUTE_TRAFFIC) and differentiates it.
"""
from __future__ import annotations

import torch

from runtime.comm import collectives
from runtime.experts.dispatch import _routed


@torch.library.custom_op("fxpar::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, ep: int, tag: str,
                   experts: int) -> torch.Tensor:
    return _routed(x, weights, index, gate_up, None, down, experts, ep, tag).clone()


@routed_experts.register_fake
def _(x, weights, index, gate_up, down, ep, tag, experts):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, weights, index, gate_up, down, ep, tag, experts = inputs
    ctx.save_for_backward(x, weights, index, gate_up, down)
    ctx.ep, ctx.tag, ctx.experts = ep, tag, experts


def _backward(ctx, grad):
    x, weights, index, gate_up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (x, weights, gate_up, down)]
    with torch.enable_grad(), collectives.recomputing():
        out = _routed(leaves[0], leaves[1], index, leaves[2], None, leaves[3], ctx.experts,
                      ctx.ep, ctx.tag)
    wanted = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    gx, gw, gg, gd = (next(got) if t.requires_grad else None for t in leaves)
    return gx, gw, None, gg, gd, None, None, None


routed_experts.register_autograd(_backward, setup_context=_setup)
