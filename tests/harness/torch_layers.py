"""Models built from PyTorch's own attention modules: blocks of nn.MultiheadAttention (its packed
in-projection viewed as (3, width), then heads merged with the batch: (batch x heads, head
width)) or nn.TransformerEncoderLayer, with a token embedding and a cross-entropy head; and an
encoder-decoder of nn.TransformerEncoderLayer and nn.TransformerDecoderLayer (cross-attention
splits the packed in-projection into the query's rows and the key's and value's in the graph)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 4, 8


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TorchLayers(nn.Module):
    def __init__(self, kind: str, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            MHABlock() if kind == "mha" else nn.TransformerEncoderLayer(
                WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class EncoderDecoder(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, source, tokens, targets):
        memory = self.embed(source)
        for block in self.encoder:
            memory = block(memory)
        x = self.embed(tokens)
        for block in self.decoder:
            x = block(x, memory)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class TorchLayersSpec:
    """(model, batch), the same on every rank; `kind` "mha", "encoder" or "encoder-decoder"."""
    kind: str = "mha"
    layers: int = 2

    def build(self):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        if self.kind == "encoder-decoder":
            source = torch.randint(0, VOCAB, (4, SEQ), generator=g)
            return EncoderDecoder(self.layers), (source, tokens[:, :-1], tokens[:, 1:])
        return TorchLayers(self.kind, self.layers), (tokens[:, :-1], tokens[:, 1:])
