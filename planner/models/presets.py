"""Reference models in plain PyTorch: a GPT and a Llama-style decoder.

Both are built from a `ModelConfig`, can be constructed on the meta device (no weights allocated),
and take `(tokens, targets)` and return the mean cross-entropy loss, so a traced graph holds the whole
training computation.

The code is written so that sharding does not require rewriting constants in the graph: head counts
never appear in reshapes (`unflatten(-1, (-1, head_dim))`), the fused QKV projection is split with
`chunk(3)` (a count, not a size), and the loss flattens with `flatten(0, 1)` instead of `view(-1, V)`.

The diffusion transformers of planner.models.dit are presets too (`dit-tiny`, `dit-xl-2`): their
`DiTConfig` goes wherever a ModelConfig does here, and builds its own model and batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.models.dit import DIT_PRESETS, DiTConfig
from planner.models.moe_config import check_moe
from planner.models.moe import MoELlama


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a decoder-only transformer.

    arch: "gpt" (learned positions, LayerNorm, GELU MLP, fused QKV) or "llama" (RMSNorm, rotary
    positions, SwiGLU MLP, grouped-query attention).  attention: "sdpa" uses the fused kernel,
    "math" writes softmax(QKᵀ)V out op by op (the form activation-memory formulas assume).
    tie: the output head shares the token embedding's weight, as GPT-2 and many others do.
    """

    arch: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    dropout: float = 0.0
    attention: str = "sdpa"
    global_batch: int = 16
    name: str = "custom"
    tie: bool = False          # the head reads the token embedding's weight (lm_head = wte)
    # Mixture of experts (planner.models.moe; llama arch only): experts > 0 makes blocks
    # dense_layers.. MoE blocks of `experts` SwiGLU experts of width expert_ffn, top_k routed.
    experts: int = 0
    top_k: int = 2
    expert_ffn: int | None = None
    shared_experts: int = 0    # always-on experts of width expert_ffn, summed in one SwiGLU
    dense_layers: int = 0      # the first blocks keep a dense SwiGLU MLP
    router: str = "softmax"    # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    aux_loss: float = 0.0      # coefficient of the per-sequence load-balancing loss
    route_scale: float = 1.0   # routed weights' scaling factor (DeepSeek-V3: 2.5)
    # Group-limited routing (DeepSeek-V3: 8 groups, 4 per token): the experts form expert_groups
    # groups of consecutive experts, each token chooses its top_k among its topk_groups best
    # groups (runtime.experts.dispatch.route); 1 and 1: no limit.
    expert_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self):
        if self.experts:
            check_moe(self)
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"model arch must be 'gpt' or 'llama', got {self.arch!r}")
        for field in ("layers", "hidden", "heads", "vocab", "seq", "global_batch"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {field} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.n_kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.n_kv_heads}")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"attention must be 'sdpa' or 'math', got {self.attention!r}")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn:
            return self.ffn
        return 4 * self.hidden if self.arch == "gpt" else _llama_ffn(self.hidden)

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


def _llama_ffn(hidden: int, multiple: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256."""
    width = int(2 * 4 * hidden / 3)
    return multiple * ((width + multiple - 1) // multiple)


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig("gpt", 8, 64, 8, 256, 32, global_batch=16, name="gpt-tiny"),
        ModelConfig("gpt", 12, 768, 12, 50257, 1024, global_batch=512, name="gpt2-small"),
        ModelConfig("gpt", 48, 1600, 25, 50257, 1024, global_batch=512, name="gpt2-xl"),
        ModelConfig("gpt", 96, 12288, 96, 50257, 2048, global_batch=1536, name="gpt3-175b"),
        ModelConfig("llama", 8, 128, 16, 256, 32, kv_heads=8, ffn=256, global_batch=16,
                    name="llama-tiny"),
        ModelConfig("llama", 32, 4096, 32, 32000, 4096, ffn=11008, global_batch=1024,
                    name="llama2-7b"),
        ModelConfig("llama", 80, 8192, 64, 32000, 4096, kv_heads=8, ffn=28672, global_batch=1024,
                    name="llama2-70b"),
        # Mixtures of experts (planner.models.moe). DeepSeek-V3's multi-head latent attention is
        # priced as multi-head attention of the same width (128 heads of hidden/heads).
        ModelConfig("llama", 4, 64, 8, 256, 32, kv_heads=4, ffn=128, global_batch=16,
                    experts=8, top_k=2, expert_ffn=64, aux_loss=0.02, name="mixtral-tiny"),
        ModelConfig("llama", 32, 4096, 32, 32000, 4096, kv_heads=8, ffn=14336, global_batch=1024,
                    experts=8, top_k=2, expert_ffn=14336, aux_loss=0.02, name="mixtral-8x7b"),
        ModelConfig("llama", 4, 64, 8, 256, 32, ffn=128, global_batch=16, experts=32, top_k=8,
                    expert_ffn=16, shared_experts=1, dense_layers=1, router="sigmoid",
                    route_scale=2.5, aux_loss=0.001, expert_groups=4, topk_groups=2,
                    name="deepseek-tiny"),
        ModelConfig("llama", 61, 7168, 128, 129280, 4096, ffn=18432, global_batch=4096,
                    experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
                    router="sigmoid", route_scale=2.5, aux_loss=0.0001, expert_groups=8,
                    topk_groups=4, name="deepseek-v3"),
    ]
}


# Every preset config: the language models above and the diffusion transformers
# (planner.models.dit.DiTConfig, whose configs build and feed their own models).
PRESET_CONFIGS = (ModelConfig, DiTConfig)


def is_preset(model) -> bool:
    """A preset's name or config (planned one block at a time), not a module."""
    return isinstance(model, (str, *PRESET_CONFIGS))


def get_config(name: str | ModelConfig | DiTConfig, **overrides) -> ModelConfig | DiTConfig:
    """A preset by name (with optional size overrides), or a config passed through."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(name, PRESET_CONFIGS):
        base = name
    elif name in PRESETS or name in DIT_PRESETS:
        base = PRESETS.get(name) or DIT_PRESETS[name]
    else:
        known = ", ".join(sorted([*PRESETS, *DIT_PRESETS]))
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}")
    return base.with_(**overrides) if overrides else base


def config_from_dict(data: dict) -> ModelConfig | DiTConfig:
    """A preset config from `dataclasses.asdict` of one (the model.json that `fxpar run
    --torchrun` and `fxpar bench` hand their ranks): a DiT's is the one with a latent size."""
    return DiTConfig(**data) if "latent" in data else ModelConfig(**data)


def build_model(config: str | ModelConfig | DiTConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Instantiate a model; on device="meta" no memory is allocated for weights."""
    config = get_config(config)
    if isinstance(config, DiTConfig):
        return config.model(device, dtype)
    cls = GPT if config.arch == "gpt" else Llama
    with torch.device(device):
        model = MoELlama(config, LlamaAttention) if config.experts else cls(config)
    return model.to(dtype)


def example_batch(config: ModelConfig | DiTConfig, batch: int, seed: int = 0, device="cpu",
                  dtype: torch.dtype = torch.float32):
    """Random (tokens, targets) of shape [batch, seq]; a DiT's (latents, timesteps, classes,
    noise), its floating inputs in `dtype`."""
    if isinstance(config, DiTConfig):
        return config.example(batch, seed, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab, (batch, config.seq), generator=gen)
    targets = torch.randint(0, config.vocab, (batch, config.seq), generator=gen)
    return tokens.to(device), targets.to(device)


def _prefix(table: torch.Tensor, length, dim: int = 0) -> torch.Tensor:
    """table[:length] along dim, written as torch.narrow so that symbolic tracing records it."""
    return torch.narrow(table, dim, 0, length)


def _causal_mask(seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)


def _attend(q, k, v, cfg: ModelConfig, mask: torch.Tensor, drop: nn.Dropout):
    """Causal attention over [batch, heads, seq, head_dim]; k/v may have fewer (grouped) heads."""
    if cfg.attention == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=cfg.n_kv_heads != cfg.heads,
            dropout_p=drop.p if drop.training else 0.0)
    if cfg.n_kv_heads != cfg.heads:
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(cfg.head_dim))
    causal = _prefix(_prefix(mask, scores.size(-2)), scores.size(-1), dim=1)
    scores = scores.masked_fill(causal, float("-inf"))
    return drop(F.softmax(scores, dim=-1)) @ v


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[b, s, heads*d] -> [b, heads, s, d] without naming the head count."""
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


class GPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.register_buffer("mask", _causal_mask(cfg.seq), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        d = self.cfg.head_dim
        y = _attend(_heads(q, d), _heads(k, d), _heads(v, d), self.cfg, self.mask, self.attn_drop)
        return self.proj(_merge_heads(y))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = GPTAttention(cfg)
        self.drop1 = nn.Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)
        self.drop2 = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.fc2(self.act(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(cfg.seq), persistent=False)

    def forward(self, tokens, targets):
        x = self.drop(self.wte(tokens) + self.wpe(_prefix(self.positions, tokens.size(1))))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _rotary_tables(cfg: ModelConfig, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x, cos, sin):
    """Rotary embedding (the half-split form used by Llama checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    seq = x.size(-2)
    return x * _prefix(cos, seq) + torch.cat([-x2, x1], dim=-1) * _prefix(sin, seq)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.attn_drop = nn.Dropout(cfg.dropout)
        cos, sin = _rotary_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("mask", _causal_mask(cfg.seq), persistent=False)

    def forward(self, x):
        d = self.cfg.head_dim
        q = _rotate(_heads(self.q_proj(x), d), self.cos, self.sin)
        k = _rotate(_heads(self.k_proj(x), d), self.cos, self.sin)
        v = _heads(self.v_proj(x), d)
        return self.o_proj(_merge_heads(_attend(q, k, v, self.cfg, self.mask, self.attn_drop)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.attn = LlamaAttention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
