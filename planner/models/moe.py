"""Mixture-of-experts decoders (Mixtral, DeepSeek-V3 style) in plain PyTorch.

A `MoELlama` is the Llama of planner.models.presets with each block's MLP replaced, from block
`dense_layers` on, by a `MoELayer`: a top-k router over `experts` SwiGLU experts (stacked weights,
one call of runtime.experts.dispatch.moe_ffn, which `torch.fx.wrap` keeps a single graph node) and an
optional always-on shared expert. The router may limit each token to its `topk_groups` best of
`expert_groups` groups of experts (DeepSeek-V3's group-limited routing). Every block is one class
(`MoEBlock`, dense or MoE inside), so capture finds the blocks as one ModuleList of one class;
dense and MoE blocks differ in their signature.

Blocks take and return `(x, aux)`: the load-balancing losses of the MoE blocks are summed along
the chain (a scalar, zero from the embedding on, that crosses pipeline stages with the
activations; every MoE block adds its own, so all MoE blocks have one signature) and added to the
cross-entropy, so `forward` returns the whole training loss.
"""
from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from planner.models.moe_config import expert_width
from runtime.experts.dispatch import moe_ffn

torch.fx.wrap("moe_ffn")


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False)
        self.up = nn.Linear(hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class MoELayer(nn.Module):
    """Router [E, h] and stacked experts; passes.rewrite.expert_parallel cuts w_gate/w_up/w_down on dim 0."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        width, h, e = expert_width(cfg), cfg.hidden, cfg.experts
        self.router = nn.Parameter(torch.empty(e, h))
        self.w_gate = nn.Parameter(torch.empty(e, width, h))
        self.w_up = nn.Parameter(torch.empty(e, width, h))
        self.w_down = nn.Parameter(torch.empty(e, h, width))
        self.shared = SwiGLU(h, width * cfg.shared_experts) if cfg.shared_experts else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The router N(0, 0.02²), each expert's matrices as nn.Linear's default; also how a
        model built on the meta device gets its values (planner.weights.materialize)."""
        h, width = self.cfg.hidden, expert_width(self.cfg)
        with torch.no_grad():
            self.router.normal_(0.0, 0.02)
            for w, fan_in in ((self.w_gate, h), (self.w_up, h), (self.w_down, width)):
                bound = 1 / math.sqrt(fan_in)
                w.uniform_(-bound, bound)

    def forward(self, h):
        c = self.cfg
        y, aux = moe_ffn(h, self.router, self.w_gate, self.w_up, self.w_down, top_k=c.top_k,
                         score=c.router, norm_topk=True, scale=c.route_scale,
                         aux_coef=c.aux_loss, groups=c.expert_groups,
                         topk_groups=c.topk_groups)
        if self.shared is not None:
            y = y + self.shared(h)
        return y, aux


class MoEBlock(nn.Module):
    def __init__(self, cfg, moe: bool, attention: type[nn.Module]):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.attn = attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.mlp = MoELayer(cfg) if moe else SwiGLU(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x, aux):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        if isinstance(self.mlp, SwiGLU):
            return x + self.mlp(h), aux
        y, extra = self.mlp(h)
        return x + y, (aux if extra is None else aux + extra)


class MoELlama(nn.Module):
    """`attention`: the block's attention class (planner.models.presets.LlamaAttention, which
    build_model passes: this module sits below planner.models.presets)."""

    def __init__(self, cfg, attention: type[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(MoEBlock(cfg, i >= cfg.dense_layers, attention)
                                    for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        aux = x.new_zeros(())   # the running sum of the blocks' balance losses
        for block in self.blocks:
            x, aux = block(x, aux)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux
