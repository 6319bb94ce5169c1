"""A hybrid language model as users write one: attention blocks that read their sizes from the
block's input (`b, n, _ = x.shape`, then `view(b, n, 3, heads, -1)` of the fused projection, and
`q, k, v = qkv` by index) alternating with blocks that have no attention at all (a squared-ReLU
MLP over per-token normalised features with a learned per-feature scale) or a gated short
convolution over the sequence (Mamba's and Hyena's: depthwise, one group per channel, as an
nn.Conv1d or as F.conv1d of a parameter). Under sequence parallelism n is each rank's share of
the sequence where the projection holds all of it; under tensor parallelism each rank convolves
its own channels; under context parallelism the attention-free MLPs run on each rank's tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 4, 8


class SizedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), \
            nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, n, -1))


class SquaredReluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.full((4 * WIDTH,), 0.7))

    def forward(self, x):
        return x + self.down(F.relu(self.up(F.normalize(x, dim=-1)) * self.scale) ** 2)


class ShortConv(nn.Module):
    """in-projection to (u, gate), u convolved causally channel by channel, gated, projected."""

    def __init__(self, form: str, kernel: int = 3):
        super().__init__()
        self.form, self.kernel = form, kernel
        self.norm, self.inp = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH)
        self.conv = nn.Conv1d(2 * WIDTH, 2 * WIDTH, kernel, groups=2 * WIDTH, padding=kernel - 1)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        u, gate = self.inp(self.norm(x)).chunk(2, dim=-1)
        u, n = u.transpose(1, 2), u.shape[1]
        if self.form == "module":
            u = self.conv(u)[..., :n]
        else:
            u = F.conv1d(F.pad(u, (self.kernel - 1, 0)), self.conv.weight, self.conv.bias,
                         groups=u.shape[1])
        return x + self.out(F.silu(u.transpose(1, 2)) * gate)


class HybridLM(nn.Module):
    def __init__(self, conv: str | None, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            SizedAttention() if i % 2 == 0 else ShortConv(conv) if conv else SquaredReluMLP()
            for i in range(layers))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class HybridSpec:
    """(model, batch), the same on every rank; `conv` ("module", "function") puts short
    convolutions in place of the MLPs."""
    conv: str | None = None
    global_batch: int = 4

    def build(self):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (self.global_batch, SEQ), generator=g)
        return HybridLM(self.conv), (tokens, tokens.roll(-1, 1))
