"""A linear whose weight is a piece of a parameter cut in the graph.

nn.MultiheadAttention's cross-attention (query from the decoder, key and value from the encoder)
cannot apply its packed in-projection whole: F.multi_head_attention_forward splits
`in_proj_weight` [3E, h] (and its bias) into the query's rows and the key's and value's,
`w.split([E, 2E])`, and applies each piece to its own input. The piece is then a linear's weight
that is no parameter of its own.

Under tensor parallelism such a parameter is cut once, per part (ShardSpec chunks: the parts are
the rows' greatest common size, E here, so rank r holds its heads' rows of q, of k and of v), and
the split in the graph takes the rank's rows of each piece (sizes divided by tp): each piece then
holds the rank's heads of every part it covers, which is what a column-parallel linear of that
piece computes when its output is read part by part (the kv piece viewed as (2, E)).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

aten = torch.ops.aten
# split(sizes) in the capture forms that take a list of sizes
_SIZED_SPLITS = {aten.split_with_sizes.default, torch.split, "split", "split_with_sizes"}
# node.meta key of a split already cut per rank: the sizes it had in one process
FULL_SIZES = "fxpar_full_sizes"


@dataclass(frozen=True)
class WeightPiece:
    """Piece `index` of a parameter split along dim 0 into rows of `sizes` by `splits` (the
    weight's split, and the bias's where it is cut alike)."""
    splits: tuple[fx.Node, ...]
    sizes: tuple[int, ...]
    index: int

    @property
    def unit(self) -> int:
        """The parts' common size: the parameter holds sum(sizes) / unit parts."""
        return math.gcd(*self.sizes)

    @property
    def parts(self) -> int:
        """How many parts this piece covers."""
        return self.sizes[self.index] // self.unit


def param_path(gm: fx.GraphModule, arg) -> str | None:
    """The path of the trained parameter `arg` reads by get_attr, else None."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        prefix, _, name = str(arg.target).rpartition(".")
        owner = gm.get_submodule(prefix) if prefix else gm
        if isinstance(getattr(owner, name, None), nn.Parameter):
            return arg.target
    return None


def piece_of(gm: fx.GraphModule, arg) -> tuple[str, fx.Node, tuple[int, ...], int] | None:
    """(parameter path, split node, full sizes, index) when `arg` is a piece of a parameter
    split along dim 0 by a list of sizes, else None."""
    if not (isinstance(arg, fx.Node) and arg.target is operator.getitem
            and isinstance(arg.args[1], int) and isinstance(arg.args[0], fx.Node)):
        return None
    split = arg.args[0]
    if split.op not in ("call_function", "call_method") or split.target not in _SIZED_SPLITS:
        return None
    sizes = split.meta.get(FULL_SIZES, split.args[1] if len(split.args) > 1 else None)
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    path = param_path(gm, split.args[0])
    if path is None or dim != 0 or not isinstance(sizes, (list, tuple)) or \
            not all(isinstance(s, int) for s in sizes):
        return None
    return path, split, tuple(sizes), arg.args[1]


def linear_pieces(gm: fx.GraphModule, weight, bias):
    """(weight path, bias path, WeightPiece) when a linear's weight is a piece of a parameter and
    its bias none or the same piece of another one; else None."""
    w = piece_of(gm, weight)
    if w is None:
        return None
    path, split, sizes, index = w
    if bias is None:
        return path, None, WeightPiece((split,), sizes, index)
    b = piece_of(gm, bias)
    if b is None or b[2:] != (sizes, index):
        return None
    return path, b[0], WeightPiece((split, b[1]), sizes, index)


def cut_splits(piece: WeightPiece, tp: int) -> None:
    """Each split takes the rank's rows of every piece: sizes divided by tp (once per split,
    however many of its pieces are linears)."""
    for split in piece.splits:
        if FULL_SIZES not in split.meta:
            split.meta[FULL_SIZES] = piece.sizes
            split.update_arg(1, [s // tp for s in piece.sizes])
