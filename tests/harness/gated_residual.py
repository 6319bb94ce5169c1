"""A language model whose MLP output is scaled per token by a gate of one feature,
sigmoid(Linear(h, 1)(x)) - Qwen2-MoE's gate on its shared expert - and whose MLP hidden features
are scaled by the sum of a gate of three (a width tp does not divide either): under tensor
parallelism those linears stay whole on every rank, the others are cut."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 4, 8


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.gate, self.inner = nn.Linear(WIDTH, 1), nn.Linear(WIDTH, 3)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, -1))
        h = self.norm2(x)
        inner = torch.sigmoid(self.inner(h)).sum(-1, keepdim=True)
        return x + torch.sigmoid(self.gate(h)) * self.down(F.silu(self.up(h)) * inner)


class GatedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


@dataclass(frozen=True)
class GatedSpec:
    global_batch: int = 4

    def build(self):
        torch.manual_seed(0)
        model = GatedLM()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (self.global_batch, SEQ), generator=gen)
        return model, (ids, torch.roll(ids, -1, 1))
