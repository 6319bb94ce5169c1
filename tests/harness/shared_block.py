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
