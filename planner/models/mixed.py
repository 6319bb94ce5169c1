"""Decoders whose blocks are not all alike: a few wide blocks then narrow ones, GPT-style and
Llama-style blocks alternating, a block of another width. They exercise the planner's runs of
identical blocks (passes.capture.block_runs, planner.search.ilp) in tests and benchmarks.

`MixedSpec` is picklable, so pooled ranks build the same model: blocks are written
"llama:256" (a Llama block, SwiGLU of width 256) or "gpt:128" (a GPT-2 block, GELU MLP of width
128); the embedding, final norm and head are Llama's, sized by `base`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.presets import GPTBlock, LlamaBlock, ModelConfig, example_batch

BLOCKS = {"gpt": GPTBlock, "llama": LlamaBlock}


def parse_block(text: str) -> tuple[str, int]:
    """"llama:256" -> ("llama", 256), with an error that names the legal forms."""
    arch, _, width = text.partition(":")
    if arch not in BLOCKS or not width.isdigit() or int(width) < 1:
        raise ValueError(f"block {text!r}: write ARCH:FFN_WIDTH with ARCH one of "
                         f"{', '.join(BLOCKS)} and a positive width, e.g. 'llama:256'")
    return arch, int(width)


class MixedDecoder(nn.Module):
    def __init__(self, base: ModelConfig, blocks: tuple[str, ...]):
        super().__init__()
        self.cfg = base
        self.embed = nn.Embedding(base.vocab, base.hidden)
        layers = []
        for text in blocks:
            arch, width = parse_block(text)
            layers.append(BLOCKS[arch](base.with_(arch=arch, ffn=width)))
        self.blocks = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(base.hidden, eps=1e-5)
        self.lm_head = nn.Linear(base.hidden, base.vocab, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class MixedSpec:
    """A MixedDecoder and its random batch (planner.training.local builds it on every rank alike)."""

    base: ModelConfig
    blocks: tuple[str, ...]
    global_batch: int = 16

    def __post_init__(self):
        if not self.blocks:
            raise ValueError("a mixed decoder needs at least one block, e.g. ('llama:256',)")
        for text in self.blocks:
            parse_block(text)

    def model(self, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> MixedDecoder:
        with torch.device(device):
            model = MixedDecoder(self.base, self.blocks)
        model.fxpar_name = f"mixed-{len(self.blocks)}"
        return model.to(dtype)

    def build(self):
        model = self.model()
        return model, example_batch(self.base, self.global_batch)
