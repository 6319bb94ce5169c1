"""runtime.checkpoint.dcp_slices against brute force: the pieces of a shard are where ShardSpec.take took
them from, a flat range's boxes tile exactly that range, and DCP (in one process) writes the
pieces of one layout and reads them back into another."""
import itertools
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from runtime.checkpoint.dcp_slices import (Piece, Slices, SlicesLoadPlanner, SlicesSavePlanner,
                                flat_range_pieces, full_shape, shard_pieces, to_full)
from runtime.programs.shards import ShardSpec


def paint(slices: Slices) -> torch.Tensor:
    """The full tensor with every piece written at its offsets (-1 elsewhere); no overlaps."""
    out = torch.full(tuple(slices.shape), -1.0)
    for p in slices.pieces:
        box = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))
        assert (out[box] == -1).all(), "pieces overlap"
        out[box] = p.tensor
    return out


# chunks: a count of equal parts, or the relative sizes of unequal ones (Phi-3's q, k, v)
SPECS = [(dim, parts, chunks, pad) for dim in (0, 1) for parts in (1, 2, 4)
         for chunks in (1, 3, (2, 1, 1)) for pad in (0, 2) if not (pad and chunks != 1)]


def _spec(dim: int, parts: int, index: int, chunks, pad: int) -> ShardSpec:
    if isinstance(chunks, tuple):
        return ShardSpec(dim, parts, index, sizes=tuple(c * parts * 2 for c in chunks))
    return ShardSpec(dim, parts, index, chunks, pad)


def _length(parts: int, chunks, pad: int) -> int:
    """Rows along the cut dimension: two per part and rank, less the padding."""
    return (sum(chunks) if isinstance(chunks, tuple) else chunks) * parts * 2 - pad


@pytest.mark.parametrize("dim,parts,chunks,pad", SPECS)
def test_shard_pieces_are_where_the_shard_came_from(dim, parts, chunks, pad):
    shape = [6, 6]
    shape[dim] = _length(parts, chunks, pad)
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    covered = torch.zeros(shape, dtype=torch.bool)
    for index in range(parts):
        spec = _spec(dim, parts, index, chunks, pad)
        local = spec.take(full)
        slices = shard_pieces(local, spec)
        assert slices.size() == full.shape == full_shape(local.shape, spec)
        painted = paint(slices)
        mask = painted != -1
        assert torch.equal(painted[mask], full[mask])
        assert not (covered & mask).any()
        covered |= mask
    assert covered.all()


@pytest.mark.parametrize("shape", [(3, 4, 5), (7,), (2, 3), (4, 1, 3), ()])
def test_flat_range_boxes_tile_the_range(shape):
    n = math.prod(shape)
    full = torch.arange(n, dtype=torch.float32).view(shape)
    for start, stop in itertools.combinations(range(n + 1), 2):
        slices = flat_range_pieces(full.flatten()[start:stop].clone(), shape, start)
        painted = paint(slices).flatten()
        assert torch.equal(painted[start:stop], full.flatten()[start:stop])
        assert (painted[:start] == -1).all() and (painted[stop:] == -1).all()


def test_pieces_outside_the_full_tensor_are_refused():
    with pytest.raises(ValueError, match=r"piece at \(4, 0\) of size \(3, 2\) lies outside"):
        Slices((6, 2), [Piece((4, 0), torch.zeros(3, 2))])


def test_dcp_writes_one_layout_and_reads_another(tmp_path):
    """Saved as two column shards; read back as row shards of two fused chunks, whole, and a
    flat range."""
    full = torch.randn(12, 8)
    specs = [ShardSpec(1, 2, i, chunks=1) for i in range(2)]
    pieces = [p for s in specs for p in shard_pieces(s.take(full), s).pieces]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        both = Slices(full.shape, pieces)  # one process writing both shards
        dcp.save({"a": both, "extra": {"step": 3}}, storage_writer=FileSystemWriter(tmp_path),
                 planner=SlicesSavePlanner(), no_dist=True)
        for spec in [ShardSpec(0, 3, 1, chunks=2), ShardSpec(0, 1, 0),
                     ShardSpec(0, 2, 1, sizes=(6, 2, 4))]:
            local = torch.zeros_like(spec.take(full))
            target = {"a": shard_pieces(local, spec), "extra": None}
            dcp.load(target, storage_reader=FileSystemReader(tmp_path),
                     planner=SlicesLoadPlanner(), no_dist=True)
            assert torch.equal(local, spec.take(full)) and target["extra"] == {"step": 3}
        flat = torch.zeros(29)
        dcp.load({"a": flat_range_pieces(flat, full.shape, 30)},
                 storage_reader=FileSystemReader(tmp_path), planner=SlicesLoadPlanner(),
                 no_dist=True)
        assert torch.equal(flat, full.flatten()[30:59])


@pytest.mark.parametrize("dim,parts,chunks,pad", [s for s in SPECS if s[1] > 1])
def test_flat_ranges_of_a_shard_land_where_the_shard_came_from(dim, parts, chunks, pad):
    """A ZeRO range of a tensor-parallel shard, mapped to the full tensor (to_full)."""
    shape = [4, 3] if dim == 0 else [3, 4]
    shape[dim] = _length(parts, chunks, pad)
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    for index in range(parts):
        spec = _spec(dim, parts, index, chunks, pad)
        local = spec.take(full)
        n = local.numel()
        for start, stop in [(0, n), (1, n - 2), (n // 3, n // 3 + 5), (n - 1, n)]:
            pieces = to_full(flat_range_pieces(local.flatten()[start:stop].clone(),
                                               local.shape, start), spec)
            painted = paint(pieces)
            mask = painted != -1
            assert torch.equal(painted[mask], full[mask])
            expected = shard_pieces(local.flatten().clone().index_fill_(
                0, torch.arange(n)[(torch.arange(n) < start) | (torch.arange(n) >= stop)],
                -1).view(local.shape), spec)
            assert torch.equal(paint(expected), painted)
