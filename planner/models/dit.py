"""Diffusion transformers (DiT, Peebles & Xie 2023) in plain PyTorch, as fxpar plans and trains
them.

A DiT denoises the latent of an image: the latent is cut into p x p patches (a stride-p Conv2d,
as the reference code's patch embedding), a fixed 2-D sin-cos table adds each patch's position,
and the conditioning vector c = MLP(sinusoid(t)) + embedding(class) of the timestep t and the
class label modulates every block through adaLN-Zero:

    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \\
        adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)        # Sequential(SiLU, Linear(h, 6h))
    x = x + gate_msa * attn(modulate(norm1(x), shift_msa, scale_msa))
    x = x + gate_mlp * mlp(modulate(norm2(x), shift_mlp, scale_mlp))

with LayerNorms without affine parameters, self-attention over the patches (a fused qkv Linear,
heads split by their width, never by a fixed count, so that tensor parallelism can cut them) and a
GELU(tanh) MLP of 4h. A final adaLN (Linear(h, 2h)) and Linear(h, p·p·C) predict each patch,
which reshapes unpatchify back into the latent; `forward(latents, t, y, noise_target)` returns
the mean squared error against the noise, so a traced graph holds the whole training step.

Sizes live in a frozen `DiTConfig`; `DIT_PRESETS` holds `dit-tiny` (trains on CPU ranks in
seconds), `dit-tiny-cross` (the cross-attention variant below) and the paper's `dit-xl-2` (675M
parameters, 118.6 GFLOPs per 256x256 image forward, counted as the paper counts them: one
multiply-add per FLOP; fxpar counts two, 237.7 GFLOPs). The reference model also learns
the variance (2C output channels) and keeps one extra class row for classifier-free guidance;
this one predicts the noise only and has no label dropout, which leaves 674.8M parameters.

With `context` > 0 the model is the cross-attention variant (PixArt-α's form): the class label is
replaced by a conditioning sequence (text features, `context` tokens of `context_dim`) that an MLP
projects to the hidden width before the blocks, and each block cross-attends to it between its
self-attention and its MLP, `x = x + cross_attn(x, ctx)`; `forward(latents, t, context,
noise_target)`. (PixArt also shares one modulation across blocks, adaLN-single; the blocks here
keep DiT's own.)

The conditioning vector enters every block, and the blocks' modulation Linear(h, 6h) is a third
of each block's weights: under tensor parallelism it is column-parallel and its output gathered
(passes.rewrite.tp_gather says why that is exact). Context parallelism splits dim 1 of the inputs,
which for latents is the channels: the planner leaves it out for these models (`sequences`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# The size overrides of the command line and of fxpar's language-model configs that a DiT has
# no use for, with what to change instead.
_NOT_APPLICABLE = {
    "vocab": "a DiT has no vocabulary (its classes are `classes`)",
    "kv_heads": "a DiT's attention has as many key/value heads as query heads",
    "seq": "a DiT's sequence is its latent's patches, (latent / patch)^2: change latent= or "
           "patch= instead",
    "arch": "a DiT preset is a DiT",
}


@dataclass(frozen=True)
class DiTConfig:
    """Sizes of a diffusion transformer.

    latent: the side of the square latent (32 for a 256x256 image through SD's VAE), channels its
    channels, patch the side of a patch: the blocks see (latent / patch)^2 patches of hidden
    features. classes: class labels of the conditioning embedding. frequency: the width of the
    timestep's sinusoidal embedding before its MLP. zero_init: adaLN-Zero, as the paper - every
    modulation and the output layer start at zero, so each block starts as the identity (off,
    every weight starts random: a test then sees every gradient non-zero from the first step).
    attention: "sdpa" uses the fused kernel, "math" writes softmax(QKᵀ/√d)V out op by op.
    """

    layers: int
    hidden: int
    heads: int
    latent: int = 32
    channels: int = 4
    patch: int = 2
    classes: int = 1000
    frequency: int = 256
    ffn: int | None = None
    global_batch: int = 256
    name: str = "custom-dit"
    zero_init: bool = True
    attention: str = "sdpa"
    context: int = 0                 # tokens of a conditioning sequence (0: class labels)
    context_dim: int | None = None   # their width (None: hidden)

    # fxpar's planner and runtime read these of every preset config.
    arch = "dit"
    sequences = False    # rates count images, not patches; context parallelism is left out

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "latent", "channels", "patch", "classes",
                     "frequency", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DiT {name} must be a positive integer, got {value!r}")
        if self.ffn is not None and (not isinstance(self.ffn, int) or self.ffn < 1):
            raise ValueError(f"DiT ffn must be a positive integer or None (4 x hidden), got "
                             f"{self.ffn!r}")
        if self.hidden % self.heads:
            raise ValueError(f"DiT hidden size {self.hidden} is not divisible by heads "
                             f"{self.heads}")
        if self.hidden % 4:
            raise ValueError(f"DiT hidden size {self.hidden} must be a multiple of 4 (the 2-D "
                             f"sin-cos position table gives each axis half, as sines and cosines)")
        if self.latent % self.patch:
            raise ValueError(f"DiT latent side {self.latent} is not divisible by patch "
                             f"{self.patch}")
        if self.frequency % 2:
            raise ValueError(f"DiT frequency (timestep embedding width) must be even, got "
                             f"{self.frequency}")
        if not isinstance(self.context, int) or isinstance(self.context, bool) or \
                self.context < 0:
            raise ValueError(f"DiT context must be a number of tokens >= 0 (0: class labels), "
                             f"got {self.context!r}")
        if self.context_dim is not None and (not isinstance(self.context_dim, int)
                                             or self.context_dim < 1):
            raise ValueError(f"DiT context_dim must be a positive integer or None (hidden), got "
                             f"{self.context_dim!r}")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"DiT attention must be 'sdpa' or 'math', got {self.attention!r}")

    @property
    def seq(self) -> int:
        """Patches per image: the blocks' sequence."""
        return (self.latent // self.patch) ** 2

    @property
    def grid(self) -> int:
        return self.latent // self.patch

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def context_width(self) -> int:
        return self.context_dim or self.hidden

    @property
    def patch_dim(self) -> int:
        """Values of one patch: p x p x C (what the output layer predicts per patch)."""
        return self.patch * self.patch * self.channels

    def with_(self, **changes) -> "DiTConfig":
        """A copy with `changes`; a size that a DiT does not have is a one-line error."""
        for key in changes:
            if key in _NOT_APPLICABLE:
                raise ValueError(f"{key} does not apply to {self.name}: "
                                 f"{_NOT_APPLICABLE[key]}")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"DiT config has no field {unknown[0]!r}; its fields: "
                             f"{', '.join(sorted(known))}")
        return replace(self, **changes)

    def sizes_text(self, global_batch_given: bool = False) -> str:
        """Where the plan's sizes come from, as the plan states them."""
        side = self.latent * 8  # (an SD VAE's latent is an eighth of the image's side)
        context = (f", cross-attending {self.context} tokens of {self.context_width}"
                   if self.context else "")
        return (f"{self.seq} patches of {self.patch}x{self.patch} per {self.latent}x"
                f"{self.latent}x{self.channels} latent ({side}x{side} image){context}: preset   "
                f"global batch: {'given' if global_batch_given else 'preset'}, counted in "
                f"images")

    # -- what fxpar's preset machinery calls (planner.models.presets) ----------------------------
    def model(self, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> "DiT":
        """The model; on device="meta" no memory is allocated for weights."""
        with torch.device(device):
            model = CrossDiT(self) if self.context else DiT(self)
        return model.to(dtype)

    def example(self, batch: int, seed: int = 0, device="cpu",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """Random (latents, t, y, noise_target) of `batch` images: noised latents, timesteps in
        [0, 1000), class labels (with `context`: a conditioning sequence of normal features),
        and the noise to predict."""
        gen = torch.Generator().manual_seed(seed)
        shape = (batch, self.channels, self.latent, self.latent)
        latents = torch.randn(shape, generator=gen)
        t = torch.randint(0, 1000, (batch,), generator=gen)
        if self.context:
            y = torch.randn(batch, self.context, self.context_width, generator=gen).to(dtype)
        else:
            y = torch.randint(0, self.classes, (batch,), generator=gen)
        noise = torch.randn(shape, generator=gen)
        return (latents.to(device, dtype), t.to(device), y.to(device), noise.to(device, dtype))

    def build(self):
        """(model, global batch): what planner.training.local trains on every rank alike."""
        return self.model(), self.example(self.global_batch)


DIT_PRESETS: dict[str, DiTConfig] = {
    c.name: c
    for c in [
        DiTConfig(4, 64, 4, latent=8, channels=4, patch=2, classes=10, frequency=32,
                  global_batch=16, name="dit-tiny"),
        DiTConfig(28, 1152, 16, latent=32, channels=4, patch=2, classes=1000,
                  global_batch=256, name="dit-xl-2"),
        DiTConfig(4, 64, 4, latent=8, channels=4, patch=2, frequency=32, context=12,
                  context_dim=32, global_batch=16, name="dit-tiny-cross"),
    ]
}


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), dim]: sines then cosines of positions at dim/2 frequencies (MAE's table)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = torch.outer(positions.to(torch.float64).flatten(), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """[grid², dim]: the 2-D position table of DiT (and MAE), patches in row-major order; half of
    the features encode the column, half the row, as the reference's meshgrid(w, h) orders them."""
    coords = torch.arange(grid, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    return torch.cat([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], dim=1).float()


class Tables(nn.Module):
    """The fixed tables, as buffers of a module of their own: the 2-D sin-cos position table and
    the timestep embedding's frequencies. A model built on the meta device gets them back from
    `cfg` alone (planner.weights.materialize rebuilds the owner of a meta buffer from its cfg)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("pos", sincos_2d(cfg.hidden, cfg.grid), persistent=False)
        half = cfg.frequency // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)


def timestep_sinusoid(t: torch.Tensor, freqs: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[b, frequency]: cos then sin of t at the table's frequencies (the reference's order),
    computed in fp32 and cast to the dtype of `like` (the patches: a bf16 model's activations
    stay bf16, as its plan prices them)."""
    args = t[:, None].float() * freqs  # fp32 (freqs as it is: traced, it stays a buffer)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).type_as(like)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class Attention(nn.Module):
    """Self-attention over the patches; heads are cut by their width, so a rank holding some of
    them reads its own without knowing how many there are in all."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        d = self.cfg.head_dim
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (part.unflatten(-1, (-1, d)).transpose(1, 2) for part in (q, k, v))
        if self.cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d)), dim=-1) @ v
        return self.proj(y.transpose(1, 2).flatten(2))


class CrossAttention(nn.Module):
    """The patches' queries over the conditioning sequence's keys and values (fused kv)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.kv = nn.Linear(cfg.hidden, 2 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x, ctx):
        d = self.cfg.head_dim
        k, v = self.kv(ctx).chunk(2, dim=-1)
        q, k, v = (part.unflatten(-1, (-1, d)).transpose(1, 2) for part in (self.q(x), k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))


class Mlp(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """A DiT block with adaLN-Zero conditioning; takes (x, c)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(cfg)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden, 6 * cfg.hidden))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
            self.adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class CrossDiTBlock(DiTBlock):
    """A DiT block that also cross-attends to the conditioning sequence; takes (x, c, ctx)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__(cfg)
        self.cross_attn = CrossAttention(cfg)

    def forward(self, x, c, ctx):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
            self.adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + self.cross_attn(x, ctx)
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    """adaLN (shift, scale) then the linear prediction of each patch's p x p x C values."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm_final = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(cfg.hidden, cfg.patch_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden, 2 * cfg.hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class TimestepEmbedder(nn.Module):
    """The timestep's sinusoid through Linear-SiLU-Linear."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(cfg.frequency, cfg.hidden), nn.SiLU(),
                                 nn.Linear(cfg.hidden, cfg.hidden))

    def forward(self, sinusoid):
        return self.mlp(sinusoid)


class DiT(nn.Module):
    block = DiTBlock

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.x_embedder = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.tables = Tables(cfg)
        self.t_embedder = TimestepEmbedder(cfg)
        self.y_embedder = self.conditioning(cfg)
        self.blocks = nn.ModuleList(type(self).block(cfg) for _ in range(cfg.layers))
        self.final_layer = FinalLayer(cfg)
        if cfg.zero_init:
            self.zero_init()

    def conditioning(self, cfg: DiTConfig) -> nn.Module:
        return nn.Embedding(cfg.classes, cfg.hidden)

    def zero_layers(self) -> list[nn.Linear]:
        layers = [b.adaLN_modulation[-1] for b in self.blocks]
        return layers + [self.final_layer.adaLN_modulation[-1], self.final_layer.linear]

    def zero_init(self) -> None:
        """adaLN-Zero: every modulation and the output layer start at zero (the paper's init)."""
        if any(p.is_meta for p in self.parameters()):
            return  # no values to set: the weights are given values per shard later
        with torch.no_grad():
            for layer in self.zero_layers():
                layer.weight.zero_()
                layer.bias.zero_()

    def embed(self, latents, t):
        """(patches with their positions [b, N, h], the timestep's conditioning [b, h])."""
        x = self.x_embedder(latents).flatten(2).transpose(1, 2) + self.tables.pos
        return x, self.t_embedder(timestep_sinusoid(t, self.tables.freqs, x))

    def loss(self, x, c, noise_target):
        """The final layer's patches, unpatchified to [b, C, H, W], against the noise."""
        cfg, p = self.cfg, self.cfg.patch
        out = self.final_layer(x, c)                                   # [b, N, p*p*C]
        image = (out.unflatten(1, (cfg.grid, cfg.grid)).unflatten(3, (p, p, cfg.channels))
                 .permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3))
        return F.mse_loss(image, noise_target)

    def forward(self, latents, t, y, noise_target):
        x, c = self.embed(latents, t)
        c = c + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.loss(x, c, noise_target)


class CrossDiT(DiT):
    """The cross-attention variant: a conditioning sequence [b, context, context_dim] (text
    features) in place of the class label, projected by an MLP (PixArt's caption projection)
    and cross-attended by every block."""

    block = CrossDiTBlock

    def conditioning(self, cfg: DiTConfig) -> nn.Module:
        return nn.Sequential(nn.Linear(cfg.context_width, cfg.hidden),
                             nn.GELU(approximate="tanh"), nn.Linear(cfg.hidden, cfg.hidden))

    def zero_layers(self) -> list[nn.Linear]:
        return super().zero_layers() + [b.cross_attn.proj for b in self.blocks]  # as PixArt

    def forward(self, latents, t, context, noise_target):
        x, c = self.embed(latents, t)
        ctx = self.y_embedder(context)
        for block in self.blocks:
            x = block(x, c, ctx)
        return self.loss(x, c, noise_target)
