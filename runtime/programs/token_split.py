"""Which tokens each rank of a context-parallel group holds, and cutting a batch accordingly.

"zigzag" (the default): the sequence is cut into 2·cp equal chunks and rank r holds chunks r and
2·cp−1−r, concatenated in that order. Under a causal mask an early chunk attends to few keys and a
late one to many, so pairing chunk r with its mirror gives every rank the same attention work.
"contiguous": rank r holds chunk r of cp; simple, but under a causal mask the last rank does cp
times the work of the first.

The local order of tokens is the only thing a rank knows about the layout; `global_positions` gives
each local token's position in the full sequence (what position embeddings must be indexed with).
"""
from __future__ import annotations

from typing import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")


def num_chunks(cp: int, layout: str = "zigzag") -> int:
    """How many equal chunks the sequence is cut into."""
    _check_layout(layout)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be a positive integer, got {cp!r}")
    return 2 * cp if layout == "zigzag" else cp


def chunk_ids(cp: int, rank: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in local order."""
    num_chunks(cp, layout)  # validates cp and layout
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {cp}")
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def check_sequence(seq: int, cp: int, layout: str = "zigzag") -> None:
    parts = num_chunks(cp, layout)
    if seq % parts:
        what = f"2·cp = {parts}" if layout == "zigzag" else f"cp = {parts}"
        raise ValueError(f"sequence length {seq} is not divisible by {what} "
                         f"(context parallel, {layout} layout)")


def holds_sequence(tensor, seq: int) -> bool:
    """Whether an input is cut along the sequence under context parallelism: two or more dims,
    dim 1 as long as the sequence (the first such input's). The others - a timestep, a context of
    another length - are whole on every rank; the trainer and the rewrite agree on this rule."""
    return isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[1] == seq


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1,
                   layout: str = "zigzag") -> torch.Tensor:
    """This rank's tokens of `tensor` (sequence on `dim`), contiguous in memory."""
    check_sequence(tensor.shape[dim], cp, layout)
    chunks = tensor.chunk(num_chunks(cp, layout), dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank, layout)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1,
                     layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard (in rank order); inverse of shard_sequence."""
    cp = len(shards)
    per_rank = len(chunk_ids(cp, 0, layout))
    chunks: list[torch.Tensor | None] = [None] * num_chunks(cp, layout)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % per_rank:
            raise ValueError(f"shard of rank {rank} has {shard.shape[dim]} tokens on dim {dim}, "
                             f"not divisible into {per_rank} chunks")
        for index, piece in zip(chunk_ids(cp, rank, layout), shard.chunk(per_rank, dim=dim)):
            chunks[index] = piece
    return torch.cat(chunks, dim=dim)


def global_positions(seq: int, cp: int, rank: int, layout: str = "zigzag",
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Position in the full sequence of each of this rank's local tokens (int64, length seq/cp)."""
    return shard_sequence(torch.arange(seq, device=device), cp, rank, dim=0, layout=layout)


def shard_batch(batch: Sequence[torch.Tensor], cp: int, rank: int, dim: int = 1,
                layout: str = "zigzag") -> list[torch.Tensor]:
    """Every per-token tensor of a batch (tokens, targets, ...) cut to this rank's tokens."""
    return [shard_sequence(t, cp, rank, dim, layout) for t in batch]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout must be one of {LAYOUTS}, got {layout!r}")
