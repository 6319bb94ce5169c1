"""The device mesh: ranks laid out pp-outermost, then dp, then tp innermost (tp groups share a node)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp index, dp index, tp index) of a global rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def groups(self, axis: str) -> list[list[int]]:
        """All rank lists along one axis ("pp", "dp" or "tp")."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [a for a in ("pp", "dp", "tp") if a != axis]
        result = []
        for fixed in product(*(range(sizes[a]) for a in others)):
            coords = dict(zip(others, fixed))
            result.append([self.rank(**{**coords, axis: i}) for i in range(sizes[axis])])
        return result


@dataclass
class RankGroups:
    """This rank's coordinates and process groups (None where the axis has size 1)."""

    mesh: Mesh
    rank: int
    pp_index: int
    dp_index: int
    tp_index: int
    tp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None

    def stage_rank(self, stage: int) -> int:
        """The global rank holding `stage` in this rank's pipeline."""
        return self.mesh.rank(stage, self.dp_index, self.tp_index)


def build_groups(mesh: Mesh) -> RankGroups:
    """Create every subgroup (all ranks must call this in the same order) and keep this rank's."""
    rank = dist.get_rank()
    if dist.get_world_size() != mesh.size:
        raise RuntimeError(f"world size {dist.get_world_size()} != mesh size {mesh.size} "
                           f"(pp={mesh.pp} x dp={mesh.dp} x tp={mesh.tp})")
    mine = {}
    for axis in ("tp", "dp", "pp"):
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[axis] = group
    return RankGroups(mesh, rank, *mesh.coords(rank), **mine)
