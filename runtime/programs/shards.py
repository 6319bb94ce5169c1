"""How a parameter was cut across tensor-parallel ranks (ShardSpec), and which parameters of a
stage program are shards. The passes cut them; the runtime joins them (full state dicts, the
gradient norm) and must know which are shards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter was cut: dimension, shard count, this rank's index, interleaved chunks, and
    zero rows appended before cutting (vocabulary padding; `join` drops them again)."""

    dim: int
    parts: int
    index: int
    chunks: int = 1
    pad: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.pad:
            shape = list(full.shape)
            shape[self.dim] = self.pad
            full = torch.cat([full, full.new_zeros(shape)], self.dim)
        pieces = full.unflatten(self.dim, (self.chunks, -1))
        shard = pieces.chunk(self.parts, dim=self.dim + 1)[self.index]
        return shard.flatten(self.dim, self.dim + 1).clone()

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        pieces = [s.unflatten(self.dim, (self.chunks, -1)) for s in shards]
        full = torch.cat(pieces, dim=self.dim + 1).flatten(self.dim, self.dim + 1)
        return full.narrow(self.dim, 0, full.shape[self.dim] - self.pad)


def shard_specs(gm: nn.Module) -> dict[str, ShardSpec]:
    """Parameter name -> how it was sharded, for every sharded parameter of a rewritten module."""
    return {name: p.fxpar_shard for name, p in gm.named_parameters() if hasattr(p, "fxpar_shard")}
