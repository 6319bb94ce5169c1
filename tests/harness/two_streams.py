"""A Flux-like model of two streams: image and text tokens, each with its own projections, joined
for one attention over both sequences (concatenated along the sequence) and cut apart again by
slicing at the text length. Under sequence parallelism both streams leave a block split along
the sequence; the cut inside the attention sees the whole sequence, so a text length held by the
model is right there and one read from a sharded stream's shape is not (refused)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEAD_DIM, IMG, TXT = 16, 4, 8, 4


class JointBlock(nn.Module):
    def __init__(self, text_len: int | None):
        super().__init__()
        self.text_len = text_len  # None: read from the text stream's shape
        self.img_qkv, self.txt_qkv = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.img_out, self.txt_out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.img_norm, self.txt_norm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, img, txt):
        t = self.text_len or txt.shape[1]
        qi, ki, vi = self.img_qkv(self.img_norm(img)).chunk(3, -1)
        qt, kt, vt = self.txt_qkv(self.txt_norm(txt)).chunk(3, -1)
        q, k, v = (torch.cat([a, b], 1).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
                   for a, b in ((qt, qi), (kt, ki), (vt, vi)))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return img + self.img_out(o[:, t:]), txt + self.txt_out(o[:, :t])


class TwoStreams(nn.Module):
    def __init__(self, text_len: int | None, layers: int = 2):
        super().__init__()
        self.img_in, self.txt_in = nn.Linear(6, WIDTH), nn.Linear(5, WIDTH)
        self.blocks = nn.ModuleList(JointBlock(text_len) for _ in range(layers))
        self.out = nn.Linear(WIDTH, 6)

    def forward(self, img, txt, target):
        i, t = self.img_in(img), self.txt_in(txt)
        for block in self.blocks:
            i, t = block(i, t)
        return F.mse_loss(self.out(i), target)


@dataclass(frozen=True)
class TwoStreamSpec:
    """(model, batch), the same on every rank; `text_len` as JointBlock takes it."""
    text_len: int | None = TXT

    def build(self):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(4, IMG, 6, generator=g), torch.randn(4, TXT, 5, generator=g),
                 torch.randn(4, IMG, 6, generator=g))
        return TwoStreams(self.text_len), batch
