"""Tiny models whose positions are written the ways users write them, sized by the input's length
(t = tokens.shape[1], a graph value, not a number): the forms passes.rewrite.context_parallel
gives each rank its global positions in (FORMS), and forms it must refuse (UNPROVABLE)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, SEQ = 32, 16, 8

# form -> positions(model, tokens, token embeddings), added to the token embeddings
FORMS = {
    "arange(t)": lambda m, tokens, x: m.wpe(torch.arange(tokens.shape[1])),
    "arange(0, t)": lambda m, tokens, x: m.wpe(   # nanoGPT
        torch.arange(0, tokens.shape[1], dtype=torch.long, device=tokens.device)),
    "arange(0, t, 1)": lambda m, tokens, x: m.wpe(torch.arange(0, tokens.size(1), 1)),
    "sin(arange(t) float)": lambda m, tokens, x: torch.sin(
        torch.arange(tokens.shape[1], dtype=torch.float32)[:, None] * m.freq),
    "pos[:t]": lambda m, tokens, x: m.pos[:tokens.shape[1]],
    "pos[0:t]": lambda m, tokens, x: m.pos[0:tokens.size(1)],
    "arange(x.size(-2))": lambda m, tokens, x: m.wpe(torch.arange(x.size(-2))),  # x: [b, t, w]
    "pos2[:, :t]": lambda m, tokens, x: m.pos2[:, :tokens.shape[1]],   # the sequence on dim 1
    # symbolic_trace cannot slice a buffer by a traced length: torch.export writes it
    # aten.slice(table, 0, 0, 8), the captured length written out
    "table[:t] (exported)": lambda m, tokens, x: m.table[:tokens.shape[1]],
}
# built from the sequence length, but not provably this rank's positions
UNPROVABLE = {
    "arange(1, t + 1)": lambda m, tokens, x: m.wpe(torch.arange(1, tokens.shape[1] + 1)),
    "pos[1:t + 1]": lambda m, tokens, x: m.pos[1:tokens.shape[1] + 1],
    # with batch = seq, dim 1 of [batch, seq, width] cannot be told from dim 0 by its size
    "arange(x.shape[1]) at batch = seq": lambda m, tokens, x: m.wpe(torch.arange(x.shape[1])),
}


class PositionEmbed(nn.Module):
    """Token embeddings plus positions written as `form` (a key of FORMS or UNPROVABLE)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ + 1, WIDTH)   # one row more than a sequence: room to offset
        nn.init.normal_(self.wpe.weight, std=1.0)
        self.pos = nn.Parameter(torch.randn(SEQ + 1, WIDTH))
        self.pos2 = nn.Parameter(torch.randn(1, SEQ + 1, WIDTH))
        self.register_buffer("table", torch.randn(SEQ + 1, WIDTH))
        self.register_buffer("freq", torch.linspace(0.1, 1.0, WIDTH))
        # only the tables the form reads: a parameter the graph never reads is in no rank's
        # program, so not in a parallel run's state to compare with one process
        reads = (FORMS | UNPROVABLE)[form].__code__.co_names
        for name in ("wpe", "pos", "pos2", "table", "freq"):
            if name not in reads:
                delattr(self, name)

    def embed(self, tokens):
        x = self.emb(tokens)
        return x + (FORMS | UNPROVABLE)[self.form](self, tokens, x)

    def forward(self, tokens, weights):
        """The embeddings weighted and summed: a scalar to capture, different for any position
        read wrong."""
        return (self.embed(tokens) * weights).sum()


class _Block(nn.Module):
    def __init__(self, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)   # traceable: no generator over a value
        q, k, v = [t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v)]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PositionLM(PositionEmbed):
    """A two-block causal LM on PositionEmbed's embeddings, returning its loss."""

    def __init__(self, form: str):
        super().__init__(form)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class PositionSpec:
    """A model spec for planner.training.local: PositionLM(form) and `batch` sequences."""
    form: str
    batch: int = 4

    def build(self):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (self.batch, SEQ + 1), generator=gen)
        return PositionLM(self.form), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
