"""The device mesh: ranks laid out pp outermost, then dp, then cp, then tp innermost.

tp innermost keeps a tensor-parallel group inside a node (its all-reduces are on the critical
path); cp next, since ring attention's point-to-point exchanges come every layer; dp's gradient
all-reduce overlaps with backward and pp's sends are small, so they may cross nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch.distributed as dist

from runtime.comm import collectives

AXES = ("pp", "dp", "cp", "tp")   # outermost first


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int
    cp: int = 1

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh {axis} must be a positive integer, got {size!r}")

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: index} of a global rank."""
        result = {}
        for axis in reversed(AXES):
            rank, result[axis] = divmod(rank, getattr(self, axis))
        return result

    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """All rank lists that vary along `axes` (one axis name, or several: ("dp", "cp") gives
        the ranks that hold the same weights) with the other coordinates fixed."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        others = [a for a in AXES if a not in axes]
        result = []
        for fixed in product(*(range(getattr(self, a)) for a in others)):
            coords = dict(zip(others, fixed))
            result.append([self.rank(**coords, **dict(zip(axes, moving)))
                           for moving in product(*(range(getattr(self, a)) for a in axes))])
        return result

    def __str__(self) -> str:
        return " x ".join(f"{axis}={getattr(self, axis)}" for axis in AXES)


@dataclass(frozen=True)
class RankGroups:
    """This rank's coordinates and process groups (None where the group has one rank).

    `replicas` is the group of ranks holding the same weights (dp x cp): gradients and the loss are
    averaged over it, since a cp rank sees a slice of every sequence as a dp rank sees a slice of
    the batch."""

    mesh: Mesh
    rank: int
    pp_index: int = 0
    dp_index: int = 0
    tp_index: int = 0
    cp_index: int = 0
    tp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    replicas: dist.ProcessGroup | None = None

    def stage_rank(self, stage: int) -> int:
        """The global rank holding `stage` in this rank's pipeline."""
        return self.mesh.rank(stage, self.dp_index, self.tp_index, self.cp_index)

    @property
    def num_replicas(self) -> int:
        return self.mesh.dp * self.mesh.cp


GROUPS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "replicas": ("dp", "cp")}


_BUILT: dict[Mesh, tuple] = {}


def per_world(cache: dict, key, make):
    """cache[key], made by make() once per default process group: an entry made under an
    earlier one (destroyed, as each dry run's is) is made again. The group is compared by
    identity, held in the entry: a new group may reuse a destroyed one's id()."""
    world = dist.group.WORLD
    entry = cache.get(key)
    if entry is None or entry[0] is not world:
        entry = cache[key] = (world, make())
    return entry[1]


def build_groups(mesh: Mesh) -> RankGroups:
    """This rank's coordinates and groups of `mesh`. The first call for a mesh creates every
    subgroup (a collective: all ranks must make the same calls in the same order); later calls in
    the same process group return them again, since each gloo group holds sockets and threads for
    as long as the process lives."""
    return per_world(_BUILT, mesh, lambda: _create_groups(mesh))


def _create_groups(mesh: Mesh) -> RankGroups:
    rank = dist.get_rank()
    if dist.get_world_size() != mesh.size:
        raise RuntimeError(f"world size {dist.get_world_size()} != mesh size {mesh.size} ({mesh})")
    mine = {}
    for name, axes in GROUPS.items():
        if name == "replicas" and 1 in (mesh.dp, mesh.cp):  # the same ranks as dp or as cp
            continue
        for ranks in mesh.groups(axes):
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[name] = group
    if "replicas" not in mine:
        mine["replicas"] = mine["dp"] if mesh.cp == 1 else mine["cp"]
    index = {f"{axis}_index": i for axis, i in mesh.coords(rank).items()}
    return RankGroups(mesh, rank, **index, **mine)


def mesh_groups(mesh: Mesh) -> RankGroups:
    """build_groups, with this rank's tp and cp groups bound for the collectives that rewritten
    graphs call by group name (runtime.comm.collectives)."""
    groups = build_groups(mesh)
    collectives.bind_groups(tp=groups.tp, cp=groups.cp)
    return groups
