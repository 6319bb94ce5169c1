"""Parameters a model uses in more than one place (a head that reads the token embedding's
weight), kept one parameter wherever the plan puts their uses.

On one rank: a rewrite that shards a parameter makes a new one for each use, so uses that were one
parameter would become two that drift apart; `tie` makes them one object again (their shards are
cut alike, or the plan is refused).

Across ranks: when the uses land on different pipeline stages, each of those stages' ranks holds a
copy. At set-up every copy takes the first holder's values; after the backward (and the
data-parallel sum) their gradients are summed over the ranks holding a copy, as Megatron does for
the embedding and the head, so every copy takes the same optimizer step and they stay equal. The
gradient norm counts the parameter once, on the first holder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.programs.stage import StageProgram
from runtime.comm.mesh import RankGroups, per_world


class TiedError(ValueError):
    """Uses of one parameter that a plan cannot keep as one parameter."""


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of one tied parameter and the ranks it is summed over."""

    names: tuple[str, ...]             # every name of the parameter, the model's own first
    param: torch.nn.Parameter
    group: dist.ProcessGroup | None    # the holders in this rank's pipeline (None: only here)
    src: int                           # global rank of the first holder
    counts_in_norm: bool               # this rank is the first holder


def _set_param(module: torch.nn.Module, path: str, value: torch.nn.Parameter) -> None:
    prefix, _, name = path.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    setattr(owner, name, value)


def _local_copy(programs: dict[int, StageProgram], names: tuple[str, ...]):
    """(stage, parameter) of this rank's uses of one tied parameter, made one object."""
    uses = [(stage, name, p) for stage, prog in sorted(programs.items())
            for name, p in prog.gm.named_parameters(remove_duplicate=False) if name in names]
    if not uses:
        return None
    stages = sorted({stage for stage, _, _ in uses})
    if len(stages) > 1:
        raise TiedError(f"parameter {names[0]} is used by stages {stages}, which this rank both "
                        f"holds; plan it with those uses in one stage or on different ranks")
    stage, first_name, first = uses[0]
    spec = getattr(first, "fxpar_shard", None)
    for _, name, p in uses[1:]:
        if p is first:
            continue
        if p.shape != first.shape or getattr(p, "fxpar_shard", None) != spec:
            raise TiedError(f"{first_name} and {name} are one parameter, but the plan shards "
                            f"them differently ({tuple(first.shape)} {spec} against "
                            f"{tuple(p.shape)} {getattr(p, 'fxpar_shard', None)}); give both "
                            f"layers the same tensor-parallel strategy")
        _set_param(programs[stage].gm, name, first)
    return stage, first


_GROUPS: dict[tuple, object] = {}


def _holder_groups(groups: RankGroups, holders: tuple[int, ...]):
    """The group of pipeline ranks `holders` in this rank's pipeline; every rank creates every
    pipeline's group, in the same order (new_group is collective), once per process group."""
    mesh = groups.mesh

    def make():
        mine = None
        for dp in range(mesh.dp):
            for cp in range(mesh.cp):
                for tp in range(mesh.tp):
                    ranks = [mesh.rank(pp, dp, tp, cp) for pp in holders]
                    group = dist.new_group(ranks)
                    if groups.rank in ranks:
                        mine = group
        return mine
    return per_world(_GROUPS, (mesh, holders), make)


def tie(programs: dict[int, StageProgram], tied: tuple[tuple[str, ...], ...],
        groups: RankGroups) -> list[TiedCopy]:
    """Make each tied parameter one object on this rank and find the ranks holding a copy.
    Collective over all ranks when the model has tied parameters (every rank must call it)."""
    tied = with_shared(tied, next(iter(programs.values())).shared_params)
    if not tied:
        return []
    local = [_local_copy(programs, names) for names in tied]
    held = [i for i, found in enumerate(local) if found is not None]
    mine = (groups.pp_index, tuple(held))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    copies = []
    for i, names in enumerate(tied):
        holders = tuple(sorted({pp for pp, idx in everyone if i in idx}))
        group = _holder_groups(groups, holders) if len(holders) > 1 else None
        if local[i] is None:
            continue
        src = groups.stage_rank(holders[0])
        copies.append(TiedCopy(names, local[i][1], group, src, groups.pp_index == holders[0]))
    return copies


def with_shared(tied: tuple[tuple[str, ...], ...], shared: tuple[str, ...]):
    """The tied groups, and a group of its own for each parameter several stages read through one
    name (StageProgram.shared_params) that no group holds yet."""
    named = {name for names in tied for name in names}
    return tuple(tied) + tuple((name,) for name in shared if name not in named)


def broadcast_tied(copies: list[TiedCopy]) -> None:
    """Every copy starts from the first holder's values."""
    for copy in copies:
        if copy.group is not None:
            with torch.no_grad():
                dist.broadcast(copy.param.data, src=copy.src, group=copy.group)


def sum_tied_grads(copies: list[TiedCopy]) -> None:
    """Sum each tied parameter's gradient over the ranks holding a copy (after the data-parallel
    sum, which leaves every replica the same gradient)."""
    for copy in copies:
        if copy.group is not None:
            if copy.param.grad is None:
                copy.param.grad = torch.zeros_like(copy.param)
            dist.all_reduce(copy.param.grad, group=copy.group)


def canonical_names(tied: tuple[tuple[str, ...], ...]) -> dict[str, str]:
    """Each name of a tied parameter -> the model's own name of it (its first)."""
    return {name: names[0] for names in tied for name in names[1:]}
