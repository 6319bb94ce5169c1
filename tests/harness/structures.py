"""Random model *structures* written as users write them, × tensor / sequence / pipeline / context
parallel plans, trained on gloo ranks and compared with one process.

tests.harness.fuzzing draws presets (GPT, Llama) whose code fxpar's authors wrote. These are
models of the kind a user brings: inputs that are tokens or features (patches, with a learned
position parameter as ViT's and DiT's), heads that end in a cross-entropy over a vocabulary, an
MSE against a target or a pooled classification; heads split from features in each way code
does it (`unflatten(-1, (heads, -1))` with a head count held by the module, `(-1, head_dim)`,
`view(b, s, heads, -1)`, sizes read from the input), rotary positions in two forms; a
conditioning vector computed once and read by every block (a diffusion transformer's timestep),
a context every block cross-attends to, and blocks given extra inputs.

A case's plan is fixed (mesh and block strategy); the planner may refuse it (a
`PlanningError` / `ValueError` is `Refused`, not a failure): what must never happen is a plan it
accepts that trains to other numbers than one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_SPLITS = ("unflatten-heads", "unflatten-width", "view-heads", "view-width", "view-shape",
               "fused-parts")
INPUTS = ("tokens", "features")
# the MLP's hidden features as they are, normalised by a LayerNorm over them written with means
# (NormFormer's), or scaled by a trained scalar times their inverse RMS, also added to the residual
MLPS = ("plain", "hidden-norm", "hidden-stats")
LOSSES = ("cross-entropy", "mse", "pooled")
# rotary positions on self-attention's q and k: none, rotate-half over real cos/sin tables
# (Hugging Face's), or complex products of a complex table (Meta's Llama, torchtitan)
ROPES = ("none", "rotate-half", "complex")
# (gpus, fix): each mixes tensor, sequence, pipeline and sharded data parallelism differently
PLANS = ((2, {"tp": 2, "strategy": "tp"}),
         (2, {"tp": 2, "strategy": "tp+sp"}),
         (2, {"pp": 2, "strategy": "none"}),
         (4, {"tp": 2, "pp": 2, "strategy": "tp"}),
         (4, {"tp": 2, "pp": 2, "strategy": "tp+sp"}),
         (4, {"tp": 2, "dp": 2, "zero": 3, "strategy": "tp+sp"}),
         (4, {"tp": 4, "strategy": "tp"}),
         (2, {"cp": 2, "strategy": "none"}))
VOCAB, WIDTH, BATCH = 32, 6, 4


@dataclass(frozen=True)
class Structure:
    """What a drawn model is made of; `build()` gives (model, batch), the same on every rank."""
    inputs: str = "tokens"
    loss: str = "cross-entropy"
    head_split: str = "unflatten-heads"
    heads: int = 4
    head_dim: int = 4
    layers: int = 2
    seq: int = 8
    condition: bool = False      # a vector every block reads (timestep embedding, adaLN-like)
    cross: bool = False          # a context every block cross-attends to
    norm: str = "layer"
    mlp: str = "plain"
    rope: str = "none"

    def line(self) -> str:
        extras = [x for x, on in (("cond", self.condition), ("cross", self.cross)) if on]
        return (f"{self.inputs}->{self.loss} L{self.layers} heads{self.heads}x{self.head_dim} "
                f"{self.head_split} s{self.seq} {self.norm}-norm {'+'.join(extras) or 'plain'} "
                f"{self.mlp}-mlp {self.rope}-rope")

    def build(self):
        torch.manual_seed(0)
        model = UserModel(self)
        gen = torch.Generator().manual_seed(1)
        b, s, h = BATCH, self.seq, self.heads * self.head_dim
        x = (torch.randint(0, VOCAB, (b, s), generator=gen) if self.inputs == "tokens"
             else torch.randn(b, s, WIDTH, generator=gen))
        target = {"cross-entropy": torch.randint(0, VOCAB, (b, s), generator=gen),
                  "mse": torch.randn(b, s, WIDTH, generator=gen),
                  "pooled": torch.randint(0, VOCAB, (b,), generator=gen)}[self.loss]
        extra = ()
        if self.condition:
            extra += (torch.rand(b, 1, generator=gen),)
        if self.cross:
            extra += (torch.randn(b, 3, h, generator=gen),)
        return model, (x, *extra, target)


class Attention(nn.Module):
    """Heads split as `head_split` says; "fused-parts" is timm's: one fused projection viewed as
    (parts, heads, head_dim), permuted and unbound, with q/k RMSNorms over head_dim;
    "per-head-fused" is Megatron's and GPT-NeoX's: one fused projection viewed as
    (heads, parts x head_dim) and chunked, each head's q, k and v side by side."""

    def __init__(self, st: Structure, cross: bool = False):
        super().__init__()
        h = st.heads * st.head_dim
        self.heads, self.head_dim, self.split = st.heads, st.head_dim, st.head_split
        self.o = nn.Linear(h, h)
        if self.split not in ("fused-parts", "per-head-fused"):
            self.q, self.k, self.v = (nn.Linear(h, h) for _ in range(3))
        elif cross:
            self.q, self.kv = nn.Linear(h, h), nn.Linear(h, 2 * h)
        else:
            self.qkv = nn.Linear(h, 3 * h)
        if self.split == "fused-parts":
            self.q_norm, self.k_norm = nn.RMSNorm(st.head_dim), nn.RMSNorm(st.head_dim)
        self.rope = "none" if cross else st.rope
        angles = torch.outer(torch.arange(st.seq).float(),
                             0.5 ** torch.arange(0, st.head_dim, 2).float())
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)
        self.register_buffer("turns", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def rotate(self, t):
        """t: [batch, heads, seq, head_dim], rotated by its positions as `rope` says."""
        if self.rope == "complex":
            pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * self.turns).flatten(-2).type_as(t)
        if self.rope == "rotate-half":
            half = t.shape[-1] // 2
            turned = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
            return t * self.cos + turned * self.sin
        return t

    def parts(self, t, n: int):
        b, s, _ = t.shape
        return t.reshape(b, s, n, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def per_head(self, t, n: int):
        b, s, _ = t.shape
        return [p.transpose(1, 2) for p in
                t.view(b, s, self.heads, n * self.head_dim).chunk(n, dim=-1)]

    def fused(self, x, context):
        if self.split == "per-head-fused":
            if context is None:
                return self.per_head(self.qkv(x), 3)
            return (*self.per_head(self.q(x), 1), *self.per_head(self.kv(context), 2))
        if context is None:
            q, k, v = self.parts(self.qkv(x), 3)
        else:
            (q,), (k, v) = self.parts(self.q(x), 1), self.parts(self.kv(context), 2)
        return self.q_norm(q), self.k_norm(k), v

    def to_heads(self, t):
        if self.split == "unflatten-heads":
            t = t.unflatten(-1, (self.heads, -1))
        elif self.split == "unflatten-width":
            t = t.unflatten(-1, (-1, self.head_dim))
        elif self.split == "view-heads":
            t = t.view(t.shape[0], t.shape[1], self.heads, -1)
        elif self.split == "view-width":
            t = t.reshape(t.shape[0], t.shape[1], -1, self.head_dim)
        else:
            t = t.view(*t.shape[:-1], t.shape[-1] // self.head_dim, self.head_dim)
        return t.transpose(1, 2)

    def forward(self, x, context=None):
        source = x if context is None else context
        if self.split in ("fused-parts", "per-head-fused"):
            q, k, v = self.fused(x, context)
        else:
            q, k, v = self.to_heads(self.q(x)), self.to_heads(self.k(source)), self.to_heads(
                self.v(source))
        q, k = self.rotate(q), self.rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=context is None)
        if self.split == "fused-parts":  # timm merges the heads to the width read from x
            b, s, c = x.shape
            return self.o(y.transpose(1, 2).reshape(b, s, c))
        return self.o(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, st: Structure):
        super().__init__()
        h = st.heads * st.head_dim
        norm = (lambda: nn.LayerNorm(h)) if st.norm == "layer" else (lambda: nn.RMSNorm(h))
        self.n1, self.n3 = norm(), norm()
        self.attn = Attention(st)
        self.n2, self.cross = (norm(), Attention(st, cross=True)) if st.cross else (None, None)
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.mlp_kind = st.mlp
        if st.mlp == "hidden-norm":
            self.norm_weight, self.norm_bias = nn.Parameter(torch.ones(2 * h)), nn.Parameter(
                torch.zeros(2 * h))
        elif st.mlp == "hidden-stats":
            self.alpha = nn.Parameter(torch.tensor(1.3))

    def mlp(self, x):
        hidden = F.gelu(self.up(x))
        if self.mlp_kind == "hidden-norm":
            centred = hidden - hidden.mean(-1, keepdim=True)
            scale = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
            return self.down(centred * scale * self.norm_weight + self.norm_bias)
        if self.mlp_kind == "hidden-stats":
            scale = self.alpha * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.down(hidden * scale) + scale
        return self.down(hidden)

    def forward(self, x, cond=None, context=None):
        y = self.n1(x)
        if cond is not None:
            y = y * (1 + cond.unsqueeze(1))
        x = x + self.attn(y)
        if self.cross is not None:
            x = x + self.cross(self.n2(x), context)
        return x + self.mlp(self.n3(x))


class UserModel(nn.Module):
    def __init__(self, st: Structure):
        super().__init__()
        h = st.heads * st.head_dim
        self.st = st
        self.embed = nn.Embedding(VOCAB, h) if st.inputs == "tokens" else nn.Linear(WIDTH, h)
        # patches get a learned position per place, as ViT's and DiT's do
        self.pos = nn.Parameter(torch.randn(1, st.seq, h) * 0.1) if st.inputs == "features" \
            else None
        self.time = nn.Sequential(nn.Linear(1, h), nn.SiLU()) if st.condition else None
        self.blocks = nn.ModuleList(Block(st) for _ in range(st.layers))
        self.norm = nn.LayerNorm(h)
        self.out = nn.Linear(h, WIDTH if st.loss == "mse" else VOCAB)

    def forward(self, x, *rest):
        *extra, target = rest
        cond = self.time(extra.pop(0)) if self.st.condition else None
        context = extra.pop(0) if self.st.cross else None
        h = self.embed(x) if self.pos is None else self.embed(x) + self.pos
        for block in self.blocks:
            h = block(h, cond, context)
        h = self.norm(h)
        if self.st.loss == "mse":
            return F.mse_loss(self.out(h), target)
        if self.st.loss == "pooled":
            return F.cross_entropy(self.out(h.mean(1)), target)
        return F.cross_entropy(self.out(h).flatten(0, 1), target.flatten())


Choose = Callable[[Sequence], object]


def build_structure(choose: Choose, plan: tuple[int, dict] | None = None
                    ) -> tuple[Structure, int, dict]:
    """(structure, gpus, fix) from a sequence of choices, simplest option first; `plan` one of
    PLANS instead of a choice."""
    gpus, fix = plan or choose(PLANS)
    tp = fix.get("tp", 1)
    # widths of 8 or more: a norm over fewer features is so ill-conditioned that summation
    # order alone moves gradients past rtol (as in tests.harness.fuzzing)
    heads = tp * choose((2, 1)) if tp > 1 else choose((2, 4))
    chunks = 2 * fix["cp"] if fix.get("cp", 1) > 1 else 1  # zig-zag: 2 chunks per cp rank
    split, head_dim = choose(HEAD_SPLITS), choose((4, 8))
    if split == "fused-parts":  # its q/k norms are over head_dim: 8 features at least
        head_dim = 8
    st = Structure(inputs=choose(INPUTS), loss=choose(LOSSES), head_split=split,
                   heads=heads, head_dim=head_dim, layers=choose((2, 3)),
                   seq=tp * chunks * choose((4, 3)), condition=choose((False, True)),
                   cross=choose((False, True)), norm=choose(("layer", "rms")), mlp=choose(MLPS),
                   rope=choose(ROPES))
    return st, gpus, {"dp": 1, "tp": 1, "pp": 1, "mb": 2, "schedule": "1f1b", **fix}


def structures(plan: tuple[int, dict] | None = None):
    """The hypothesis strategy of `build_structure` (for one of PLANS, if given)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw_one):
        return build_structure(lambda options: draw_one(st.sampled_from(list(options))), plan)
    return draw()
