"""A linear's output read as slices of its features that tile them, made one sized split.

Phi-3 reads its fused projections as slices: `qkv[..., :q]`, `qkv[..., q:q + kv]`,
`qkv[..., q + kv:]`. Slices that together cover the features once are what
`split(x, [q, kv, kv], dim=-1)` says in one node, which tensor parallelism reads as a fused
projection's parts (passes.rewrite.fused_parts): each part's features cut over the ranks, the
split's sizes divided by tp. The capture rewrites the slices into that split: the same views of
the same features, so one process computes the same values.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten
_LINEARS = {F.linear, aten.linear.default, torch._C._nn.linear}


def slices_to_splits(gm: fx.GraphModule) -> None:
    """Rewrite every linear output read only by slices of its last dimension that tile it."""
    changed = False
    for node in list(gm.graph.nodes):
        if not _is_linear(gm, node):
            continue
        tiles = _tiling(node)
        if tiles is None:
            continue
        sizes = tuple(end - start for start, end, _ in tiles)
        with gm.graph.inserting_after(node):
            split = gm.graph.call_function(aten.split_with_sizes.default, (node, list(sizes), -1))
        split.meta = {**tiles[0][2].meta, "val": tuple(s.meta["val"] for *_, s in tiles)}
        for i, (*_, piece) in enumerate(tiles):
            piece.op, piece.target, piece.args, piece.kwargs = \
                "call_function", operator.getitem, (split, i), {}
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _is_linear(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.Linear)
    return node.op == "call_function" and node.target in _LINEARS


def _tiling(node: fx.Node) -> list[tuple[int, int, fx.Node]] | None:
    """(start, end, slice) of each user of `node`, in order, when they are at least two slices
    of its last dimension that cover it once; else None."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or len(node.users) < 2:
        return None
    width, tiles = value.shape[-1], []
    for user in node.users:
        bounds = _last_dim_slice(user, value.dim(), width)
        if bounds is None:
            return None
        tiles.append((*bounds, user))
    tiles.sort(key=lambda t: t[0])
    at = 0
    for start, end, _ in tiles:
        if start != at or end <= start:
            return None
        at = end
    return tiles if at == width else None


def _last_dim_slice(user: fx.Node, ndim: int, width: int) -> tuple[int, int] | None:
    """(start, end) when `user` slices the last dimension of its input with step 1 (as aten's
    slice or basic indexing `x[..., a:b]`), taking the others whole; else None."""
    if user.op != "call_function":
        return None
    if user.target is aten.slice.Tensor:
        dim, start, end, step = (list(user.args[1:]) + [0, None, None, 1][len(user.args) - 1:])
        if not isinstance(dim, int) or dim % ndim != ndim - 1:
            return None
        return _bounds(slice(start, end, step), width)
    if user.target is operator.getitem and isinstance(user.args[1], tuple):
        index = user.args[1]
        if Ellipsis in index[:-1]:
            if index[:-1] != (Ellipsis,):
                return None
        elif len(index) != ndim or any(i != slice(None) for i in index[:-1]):
            return None
        return _bounds(index[-1], width) if isinstance(index[-1], slice) else None
    return None


def _bounds(s: slice, width: int) -> tuple[int, int] | None:
    """[start, end) of a slice of `width` features (negative bounds from the end, as Python
    reads them); None for a step or a bound computed at run time."""
    start, end = (0 if s.start is None else s.start), (width if s.stop is None else s.stop)
    if s.step not in (None, 1) or not isinstance(start, int) or not isinstance(end, int):
        return None
    start, end = (b + width if b < 0 else min(b, width) for b in (start, end))
    return (start, end) if 0 <= start < end else None
