"""A rank's part of a full tensor, described to torch.distributed.checkpoint (DCP) as rectangular
pieces at offsets in the full tensor, so that a checkpoint saved under one mesh loads under any
other: DCP reads, for every piece a rank holds now, the overlap with every piece saved.

Why DCP's own chunk metadata and not DTensor: fxpar's shards are not what a DTensor placement
can say. A fused QKV weight cut by runtime.programs.shards.ShardSpec with chunks=3 (or part
sizes) holds, on each tp rank, three separate row ranges of the full weight; a vocabulary-parallel
embedding padded to a multiple of tp holds zero rows past the full tensor's end on the last rank; under ZeRO an
optimizer state is a flat range of a parameter. Each of these is a list of boxes (offsets, sizes)
in the full tensor, which is exactly DCP's ChunkStorageMetadata, with no process group or
DeviceMesh needed to describe it. Ranks holding the same piece (data-parallel replicas, the copies
tensor parallelism leaves whole, tied copies on several stages) name the same box and DCP's
dedup_save_plans keeps one writer for it.

`Slices` carries the protocol DCP's planner helpers look for (`__create_write_items__`,
`__create_chunk_list__`); SlicesSavePlanner / SlicesLoadPlanner hand DCP the piece a write or
read item names. Pieces are views of the rank's own tensors: a load writes into them in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from runtime.programs.shards import ShardSpec


@dataclass(frozen=True)
class Piece:
    """A box of the full tensor (offsets, sizes) and the view of local storage that holds it."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


class Slices:
    """One state-dict entry: the full tensor's shape and the pieces of it this rank holds."""

    def __init__(self, shape: Sequence[int], pieces: Sequence[Piece]):
        self.shape = torch.Size(shape)
        self.pieces = list(pieces)
        for p in self.pieces:
            if len(p.offsets) != len(self.shape) or any(
                    o < 0 or o + s > n for o, s, n in zip(p.offsets, p.sizes, self.shape)):
                raise ValueError(f"piece at {p.offsets} of size {p.sizes} lies outside the full "
                                 f"shape {tuple(self.shape)}")

    def size(self) -> torch.Size:  # DCP compares it with the saved tensor's size on load
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, p.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(p.offsets),
                                                         torch.Size(p.sizes)),
                              properties=TensorProperties.create_from_tensor(p.tensor),
                              size=self.shape))
                for p in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes))
                for p in self.pieces]

    def piece_at(self, offsets) -> torch.Tensor:
        offsets = tuple(offsets)
        for p in self.pieces:
            if p.offsets == offsets:
                return p.tensor
        raise KeyError(f"no piece at {offsets}")


def whole(tensor: torch.Tensor) -> Slices:
    """A tensor this rank holds whole."""
    return Slices(tensor.shape, [Piece((0,) * tensor.dim(), tensor)])


def full_shape(local: torch.Size, spec: ShardSpec) -> torch.Size:
    """The full tensor's shape of a shard cut by `spec` (the shards are equal: passes check it)."""
    shape = list(local)
    shape[spec.dim] = local[spec.dim] * spec.parts - spec.pad
    return torch.Size(shape)


def _blocks(local: torch.Size, spec: ShardSpec) -> list[tuple[int, int, int]]:
    """(start in the shard, start in the full tensor, rows) of each block a shard cut by `spec`
    holds (ShardSpec.ranges), the rows of vocabulary padding left out."""
    dim, shape = spec.dim, full_shape(local, spec)
    blocks, at = [], 0
    for start, end in spec.ranges(shape[dim]):
        kept = min(end, shape[dim]) - start
        if kept > 0:
            blocks.append((at, start, kept))
        at += end - start
    if at != local[dim]:
        raise ValueError(f"a shard of {local[dim]} along dim {dim} is not the {at} rows {spec} "
                         f"cuts")
    return blocks


def shard_pieces(local: torch.Tensor, spec: ShardSpec) -> Slices:
    """The pieces of a shard cut by `spec` (runtime.programs.shards.ShardSpec.take): one per block
    of the full tensor it holds (one per part of a fused weight); padding rows left out."""
    pieces = []
    for at, start, rows in _blocks(local.shape, spec):
        offsets = [0] * local.dim()
        offsets[spec.dim] = start
        pieces.append(Piece(tuple(offsets), local.narrow(spec.dim, at, rows)))
    return Slices(full_shape(local.shape, spec), pieces)


def to_full(local: Slices, spec: ShardSpec) -> Slices:
    """Pieces given in the coordinates of a shard cut by `spec` (a ZeRO range of a tp shard) in
    the coordinates of the full tensor: each piece split where the shard's blocks meet, the
    padding rows left out."""
    dim, blocks = spec.dim, _blocks(local.shape, spec)
    pieces = []
    for p in local.pieces:
        lo, hi = p.offsets[dim], p.offsets[dim] + p.sizes[dim]
        for at, start, rows in blocks:
            a, b = max(lo, at), min(hi, at + rows)
            if a < b:
                offsets = list(p.offsets)
                offsets[dim] = start + a - at
                pieces.append(Piece(tuple(offsets), p.tensor.narrow(dim, a - lo, b - a)))
    return Slices(full_shape(local.shape, spec), pieces)


def flat_range_pieces(flat: torch.Tensor, shape: Sequence[int], start: int) -> Slices:
    """A flat range [start, start + flat.numel()) of a row-major tensor of `shape` (a ZeRO shard
    of a parameter or of its optimizer state), as boxes: a partial run of the innermost dimension,
    then whole blocks of every dimension in turn, then a partial run again."""
    shape = tuple(int(n) for n in shape)
    stop = start + flat.numel()
    if start < 0 or stop > math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) lies outside a tensor of {shape}")
    pieces, at = [], start
    while at < stop:
        size, dims = _largest_box(shape, at, stop)
        offsets = _unravel(at, shape)
        box = [1] * (len(shape) - dims) + list(size)
        n = math.prod(box)
        view = flat[at - start: at - start + n].view(box if shape else ())
        pieces.append(Piece(offsets, view))
        at += n
    return Slices(shape, pieces)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for n in reversed(shape):
        index, r = divmod(index, n)
        coords.append(r)
    return tuple(reversed(coords))


def _largest_box(shape: tuple[int, ...], at: int, stop: int) -> tuple[list[int], int]:
    """The largest box starting at flat index `at` that is a contiguous run ending by `stop`:
    sizes of its last `dims` dimensions (the others are 1)."""
    if not shape:
        return [], 0
    best, best_dims, inner = [1], 1, 1
    coords = _unravel(at, shape)
    for dims in range(1, len(shape) + 1):
        d = len(shape) - dims
        inner_full = all(c == 0 for c in coords[d + 1:])
        if not inner_full:
            break
        count = min(shape[d] - coords[d], (stop - at) // inner)
        if count < 1:
            break
        best, best_dims = [count] + list(shape[d + 1:]), dims
        if count < shape[d] - coords[d] or coords[d] != 0:
            break
        inner *= shape[d]
    return best, best_dims


class SlicesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, handing over the piece a write item names (a copy: torch.save
    of a view would write its whole storage). The state dict is flat: a value that is not a
    tensor (a dict of RNG states, a list of hyperparameters) is pickled whole, not flattened."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.piece_at(index.offset).contiguous().clone()
        return super().lookup_object(index)


class SlicesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading into the piece a read item names (in place)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's _init_state_dict replaces every value of a type it does not know with None.
        slices = {key: value for key, value in state_dict.items() if isinstance(value, Slices)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(slices)
        self.state_dict.update(slices)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.piece_at(index.offset)
        return super().lookup_tensor(index)
