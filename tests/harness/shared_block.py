"""A model whose list of blocks holds one block several times (ALBERT shares one layer's weights
across its depth): capture names the module once, so its applications are one layer, and a
rewrite must cut its weights once, however many places apply them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h: int = 16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ChainLM(nn.Module):
    """Token embedding (32 tokens, 16 wide), `blocks` in one list, a cross-entropy head."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def shared_blocks(depth: int = 4) -> ChainLM:
    return ChainLM([Block()] * depth)


@dataclass(frozen=True)
class SharedBlocksSpec:
    def build(self):
        torch.manual_seed(0)
        tokens = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(1))
        return shared_blocks(), (tokens[:, :-1], tokens[:, 1:])


class ScaledBlock(nn.Module):
    """An MLP whose hidden features are scaled by a value that is whole on every tp rank and
    broadcast over them: the inverse RMS of the block's input, or a router's gate per expert
    (gates inside the experts). Each rank's part of the output gives it only its share of that
    value's gradient."""

    def __init__(self, scale: str, h: int = 16, experts: int = 2):
        super().__init__()
        self.scale = scale
        self.router = nn.Linear(h, experts) if scale == "gate" else None
        self.up = nn.ModuleList(nn.Linear(h, 4 * h) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(4 * h, h) for _ in range(experts))

    def forward(self, x):
        if self.router is not None:
            gates = F.softmax(self.router(x), dim=-1)
        else:
            gates = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6).expand(-1, -1, 2)
        out = x
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            out = out + down(F.gelu(up(x)) * gates[..., e:e + 1])
        return out


def _inverse_rms(x):
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class StatsScaledBlock(nn.Module):
    """An MLP whose hidden features are scaled by their own inverse RMS (statistics summed over
    the sharded features under tp), combined with other values that carry a gradient: a trained
    scalar, the inverse RMS of the block's input, and/or read whole again by the residual add.
    `scale`: words joined by "+" among "alpha", "input", "added"."""

    def __init__(self, scale: str, h: int = 16):
        super().__init__()
        self.parts = set(scale.split("+"))
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.alpha = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        hidden = F.gelu(self.up(x))
        scale = _inverse_rms(hidden)
        if "alpha" in self.parts:
            scale = self.alpha * scale
        if "input" in self.parts:
            scale = scale * _inverse_rms(x)
        out = x + self.down(hidden * scale)
        return out + scale if "added" in self.parts else out


@dataclass(frozen=True)
class ScaledBlocksSpec:
    scale: str  # "rms" or "gate" (ScaledBlock), else StatsScaledBlock's

    def build(self):
        torch.manual_seed(0)
        tokens = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(1))
        kind = ScaledBlock if self.scale in ("rms", "gate") else StatsScaledBlock
        return ChainLM([kind(self.scale) for _ in range(2)]), (tokens[:, :-1], tokens[:, 1:])
