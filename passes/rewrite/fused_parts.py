"""A fused projection: one linear whose output features are read as parts (q, k and v).

Tensor parallelism cuts such a linear per part - each part's features split over the ranks, a
rank holding its block of every part - and the split that reads the parts then takes each
rank's share of them. The parts are read by a chunk into equal parts, a split by one size or by
a list of sizes (unequal parts: Phi-3's q beside fewer kv heads), right after the linear or
after views that keep its features whole (GPT-2's Conv1D reshaped back to [b, s, out]).

A view that regroups the features first (`view(b, s, heads, 3 * head_dim)`, the per-head layout
of GPT-NeoX and Megatron) makes a chunk of the last dimension one within each head: no fused
projection, but heads, which a plain column cut keeps whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from passes.rewrite.sharding import _RESHAPES, ShardingError

aten = torch.ops.aten
_CHUNK = {"chunk", torch.chunk, aten.chunk.default}
_SPLIT = {"split", torch.split, aten.split.Tensor, aten.split_with_sizes.default,
          "split_with_sizes"}


@dataclass(frozen=True)
class FusedCut:
    """The split that reads a fused projection's parts: `parts` of them, of these `sizes` (equal
    for a chunk or a split by one size)."""
    user: fx.Node
    sizes: tuple[int, ...]

    @property
    def parts(self) -> int:
        return len(self.sizes)

    @property
    def equal(self) -> bool:
        return len(set(self.sizes)) == 1

    def localize(self, tp: int, layer: str) -> None:
        """Each rank reads its share of every part: a split's sizes divided by tp (a chunk's
        count stays)."""
        if any(size % tp for size in self.sizes):
            raise ShardingError(f"layer {layer}: {self.user.name} reads parts of "
                                f"{list(self.sizes)} features, not all divisible by tp={tp}")
        if self.user.target in _CHUNK:
            return
        given = self.user.args[1]
        local = [size // tp for size in self.sizes]
        self.user.update_arg(1, given // tp if isinstance(given, int) else type(given)(local))


def fused_cut(node: fx.Node) -> FusedCut | None:
    """The fused-projection split reading `node`'s output features, or None."""
    node = _after_width_views(node)
    users = list(node.users)
    if len(users) != 1 or len(users[0].args) < 2:
        return None
    user, given, width = users[0], users[0].args[1], node.meta["val"].shape[-1]
    ndim = node.meta["val"].dim()
    dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None  # a split of another dimension (the batch, the sequence)
    if user.target in _CHUNK and isinstance(given, int) and width % given == 0:
        return FusedCut(user, (width // given,) * given)
    if user.target not in _SPLIT:
        return None
    if isinstance(given, int) and given > 0 and width % given == 0:
        return FusedCut(user, (given,) * (width // given))
    if isinstance(given, (list, tuple)) and all(isinstance(s, int) for s in given) and \
            sum(given) == width:
        return FusedCut(user, tuple(given))
    return None


def _after_width_views(node: fx.Node) -> fx.Node:
    """The last of the views after node that keep its last dimension whole."""
    width = node.meta["val"].shape[-1]
    while len(node.users) == 1 and next(iter(node.users)).target in _RESHAPES:
        view = next(iter(node.users)).meta.get("val")
        if not isinstance(view, torch.Tensor) or view.dim() == 0 or view.shape[-1] != width:
            break
        node = next(iter(node.users))
    return node
