"""An image classifier as timm writes its vision transformer: a patch-embedding convolution, a
class token and learned positions, the blocks in an nn.Sequential called once, the fused qkv
viewed as (3, heads, head_dim), permuted and unbound, the class token's features classified
with a cross-entropy. Its inputs are images, not sequences (sequence_dim=None)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, CLASSES, PATCHES = 16, 4, 10, 16


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, WIDTH))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SequentialViT(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.patch = nn.Conv2d(3, WIDTH, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, PATCHES + 1, WIDTH) * 0.1)
        self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, images, labels):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return F.cross_entropy(self.head(self.norm(self.blocks(x))[:, 0]), labels)


@dataclass(frozen=True)
class SequentialViTSpec:
    global_batch: int = 8

    def build(self):
        torch.manual_seed(0)
        model = SequentialViT()
        gen = torch.Generator().manual_seed(1)
        return model, (torch.randn(self.global_batch, 3, 16, 16, generator=gen),
                       torch.randint(0, CLASSES, (self.global_batch,), generator=gen))
