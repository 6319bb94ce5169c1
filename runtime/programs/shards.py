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
    zero rows appended before cutting (vocabulary padding; `join` drops them again). A fused
    projection of unequal parts (Phi-3's q, k and v) gives their `sizes` instead of chunks: each
    part is cut into `parts` blocks and a rank holds its block of every part."""

    dim: int
    parts: int
    index: int
    chunks: int = 1
    pad: int = 0
    sizes: tuple[int, ...] = ()

    def __post_init__(self):
        if self.sizes and (self.pad or self.chunks != 1):
            raise ValueError(f"a cut by part sizes {self.sizes} takes no chunks or padding")

    def part_sizes(self, full: int) -> tuple[int, ...]:
        """The parts of the dimension (of `full` rows, padding added) that are cut one by one."""
        if self.sizes:
            return self.sizes
        return ((full + self.pad) // self.chunks,) * self.chunks

    def ranges(self, full: int) -> list[tuple[int, int]]:
        """The [start, end) rows of the dimension (of `full` rows) this shard holds, in order; a
        range past `full` is vocabulary padding."""
        ranges, start = [], 0
        for size in self.part_sizes(full):
            block = size // self.parts
            ranges.append((start + self.index * block, start + (self.index + 1) * block))
            start += size
        return ranges

    def take(self, full: torch.Tensor) -> torch.Tensor:
        ranges = self.ranges(full.shape[self.dim])
        if self.pad:
            shape = list(full.shape)
            shape[self.dim] = self.pad
            full = torch.cat([full, full.new_zeros(shape)], self.dim)
        pieces = [full.narrow(self.dim, a, b - a) for a, b in ranges]
        return torch.cat(pieces, self.dim).clone()

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        local = [size // self.parts for size in self.part_sizes(
            shards[0].shape[self.dim] * self.parts - self.pad)]
        per_rank = [s.split(local, self.dim) for s in shards]
        full = torch.cat([p[i] for i in range(len(local)) for p in per_rank], self.dim)
        return full.narrow(self.dim, 0, full.shape[self.dim] - self.pad)


def shard_specs(gm: nn.Module) -> dict[str, ShardSpec]:
    """Parameter name -> how it was sharded, for every sharded parameter of a rewritten module."""
    return {name: p.fxpar_shard for name, p in gm.named_parameters() if hasattr(p, "fxpar_shard")}
