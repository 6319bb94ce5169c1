"""The routed experts as one custom op, `torch.ops.fxpar.routed_experts`, so that a model captured
with torch.export (Hugging Face's MoE blocks) keeps them one graph node the expert-parallel
rewrite can cut, as `torch.fx.wrap` keeps `runtime.experts.dispatch.moe_ffn` one node under symbolic
tracing.

    routed_experts(x [T, h], weights [T, k], index [T, k], gate_up, down, ep, tag, experts,
                   gate_up_bias=None, down_bias=None, kind="swiglu", alpha=1.0, limit=0.0,
                   groups=1, topk_groups=1)
        -> [T, h]

is sum over each token's k slots of weight x expert(x), expert the slot's expert in `index`,
dispatched and combined over the EP group as runtime.experts.dispatch does (dropless). `kind`
says what an expert computes and how its weights lie (runtime.experts.dispatch.ExpertWeights):

  "swiglu"   down(silu(gate x) * up x), gate_up [E/ep, 2f, h] (gate rows, then up rows: Hugging
             Face's fused layout of Mixtral, Qwen3-MoE, DeepSeek), down [E/ep, h, f]; biases
             [E/ep, 2f] and [E/ep, h] added to the two products when given.
  "gpt_oss"  GPT-OSS: gate_up [E/ep, h, 2f] (transposed, gate and up interleaved) plus bias
             [E/ep, 2f]; g = min(gate, limit), u = clamp(up, -limit, limit);
             ((u + 1) g sigmoid(alpha g)) down + bias, down [E/ep, f, h], bias [E/ep, h].

`groups`, `topk_groups` compute nothing: they record the group limit of the router that chose
`index` (DeepSeek-V3's: each token's experts lie in its topk_groups of `groups` groups of
consecutive experts; 1, 1 for none), which the router outside the op knows and the graph does not,
for cost_model.ops.moe to price the dispatch with (planner.models.hf_moe reads them off the router).

Every weight and bias holds this rank's E/ep experts on dim 0 (what passes.rewrite.expert_parallel
cuts). Its backward runs the forward again under autograd (the experts are recomputed, as under
activation checkpointing; the repeated all-to-all is counted apart, in RECOMPUTE_TRAFFIC) and
differentiates it: x, weights, the expert weights and biases get gradients.
"""
from __future__ import annotations

from typing import Optional

import torch

from runtime.comm import collectives
from runtime.experts.dispatch import ExpertWeights, _routed, check_groups

# routed_experts' positional arguments (as a captured node holds them): the expert weights and
# biases, all cut along dim 0 (experts) by the expert-parallel rewrite.
ARGS = ("x", "weights", "index", "gate_up", "down", "ep", "tag", "experts", "gate_up_bias",
        "down_bias", "kind", "alpha", "limit", "groups", "topk_groups")
EXPERT_ARGS = (3, 4, 8, 9)


@torch.library.custom_op("fxpar::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, ep: int, tag: str,
                   experts: int, gate_up_bias: Optional[torch.Tensor] = None,
                   down_bias: Optional[torch.Tensor] = None, kind: str = "swiglu",
                   alpha: float = 1.0, limit: float = 0.0, groups: int = 1,
                   topk_groups: int = 1) -> torch.Tensor:
    check_groups(experts, index.shape[-1], groups, topk_groups)
    w = ExpertWeights(gate_up, None, down, gate_up_bias, down_bias, kind, alpha, limit)
    return _routed(x, weights, index, w, experts, ep, tag).clone()


@routed_experts.register_fake
def _(x, weights, index, gate_up, down, ep, tag, experts, gate_up_bias=None, down_bias=None,
      kind="swiglu", alpha=1.0, limit=0.0, groups=1, topk_groups=1):
    check_groups(experts, index.shape[-1], groups, topk_groups)
    return x.new_empty(x.shape)


def arguments(node) -> dict:
    """A captured routed_experts node's arguments by name, the defaults filled in (torch.export
    may leave trailing defaults off the node)."""
    schema = node.target._schema.arguments
    got = {a.name: a.default_value for a in schema if a.has_default_value()}
    got.update(zip((a.name for a in schema), node.args))
    got.update(node.kwargs)
    return got


# The differentiable tensor inputs, by position (x, weights, the expert weights and biases);
# index (integers) is not one.
_LEAVES = (0, 1, *EXPERT_ARGS)
_CONSTANTS = (5, 6, 7, 10, 11, 12)   # ep, tag, experts, kind, alpha, limit


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*(inputs[i] for i in _LEAVES), inputs[2])
    ctx.ep, ctx.tag, ctx.experts, ctx.kind, ctx.alpha, ctx.limit = (inputs[i] for i in _CONSTANTS)


def _backward(ctx, grad):
    *saved, index = ctx.saved_tensors
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in saved]
    x, weights, gate_up, down, gate_up_bias, down_bias = leaves
    with torch.enable_grad(), collectives.recomputing():
        w = ExpertWeights(gate_up, None, down, gate_up_bias, down_bias, ctx.kind, ctx.alpha,
                          ctx.limit)
        out = _routed(x, weights, index, w, ctx.experts, ctx.ep, ctx.tag)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
    grads = [None] * len(ARGS)
    for i, t in zip(_LEAVES, leaves):
        if t is not None and t.requires_grad:
            grads[i] = next(got)
    return tuple(grads)


routed_experts.register_autograd(_backward, setup_context=_setup)
