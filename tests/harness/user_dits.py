"""Diffusion transformers as users write them, in forms the presets do not use: patches cut with
`unfold`, the batch size read once at the top of forward and used by the blocks and the head,
an MSE loss against the noise, and adaLN modulation as PixArt-alpha writes it (one shared
projection of the timestep, `t.reshape(B, 6, -1)` added to a table of each block's, then
`chunk(6, dim=1)`) or as diffusers' DiT and SD3 blocks do (`Linear(h, 6h)` of the conditioning,
`chunk(6, dim=1)`, each part broadcast over the tokens with `[:, None]`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

H, HEADS, PATCH, CHANNELS, IMAGE = 32, 4, 2, 4, 8


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def patches(images: torch.Tensor, batch: int) -> torch.Tensor:
    p = PATCH
    return images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(
        batch, -1, CHANNELS * p * p)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(H, H) for _ in range(3))
        self.to_out = nn.Linear(H, H)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, HEADS, H // HEADS).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, H))


def _norm() -> nn.LayerNorm:
    return nn.LayerNorm(H, elementwise_affine=False)


class PixArtBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2, self.attn = _norm(), _norm(), Attention()
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * H, H))
        self.scale_shift_table = nn.Parameter(torch.randn(6, H) / H ** 0.5)

    def forward(self, x, t):
        batch = x.shape[0]
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (
            self.scale_shift_table[None] + t.reshape(batch, 6, -1)).chunk(6, dim=1)
        x = x + gate_a * self.attn(self.norm1(x) * (1 + scale_a) + shift_a)
        return x + gate_m * self.mlp(self.norm2(x) * (1 + scale_m) + shift_m)


class AdaLNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ada = nn.Linear(H, 6 * H)
        self.norm1, self.norm2, self.attn = _norm(), _norm(), Attention()
        self.ff = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))

    def forward(self, x, c):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(F.silu(c)).chunk(6, dim=1)
        x = x + gate_a.unsqueeze(1) * self.attn(self.norm1(x) * (1 + scale_a[:, None])
                                                + shift_a[:, None])
        return x + gate_m.unsqueeze(1) * self.ff(self.norm2(x) * (1 + scale_m[:, None])
                                                 + shift_m[:, None])


class UserDiT(nn.Module):
    def __init__(self, kind: str, layers: int = 2):
        super().__init__()
        self.kind = kind
        self.patch = nn.Linear(CHANNELS * PATCH * PATCH, H)
        self.pos = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2, H) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(H, H), nn.SiLU(), nn.Linear(H, H))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(H, 6 * H))  # PixArt's adaLN-single
        block = PixArtBlock if kind == "pixart" else AdaLNBlock
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        self.norm_out, self.proj_out = nn.LayerNorm(H), nn.Linear(H, CHANNELS * PATCH * PATCH)

    def forward(self, latents, t, noise):
        batch = latents.shape[0]     # read once, used by the blocks' and the head's reshapes
        x = self.patch(patches(latents, batch)) + self.pos
        c = self.t_mlp(timestep_embedding(t, H))
        cond = self.t_block(c) if self.kind == "pixart" else c
        for block in self.blocks:
            x = block(x, cond)
        out = self.proj_out(self.norm_out(x))
        return F.mse_loss(out, patches(noise, batch))


@dataclass(frozen=True)
class UserDiTSpec:
    """(model, batch) the same on every rank; `kind` "pixart" or "adaln"."""
    kind: str = "pixart"

    def build(self):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        shape = (8, CHANNELS, IMAGE, IMAGE)
        return UserDiT(self.kind), (torch.randn(*shape, generator=g),
                                    torch.randint(0, 1000, (8,), generator=g),
                                    torch.randn(*shape, generator=g))
