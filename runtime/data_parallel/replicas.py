"""Make the copies of every weight equal at set-up, whatever the user's seeding.

Each rank builds its shard from the model it was given. Without a common seed the ranks' models
differ, and ranks that should hold the same values would not: data-parallel (and context-parallel)
replicas of a stage, and the tensor-parallel ranks' copies of the parameters tensor parallelism
leaves whole (norms, row-parallel biases). Both are broadcast here, as DDP does at construction:
the replicated parameters from tensor-parallel index 0 over the tp group, then every parameter
from the first replica over the dp x cp group. Tensor-parallel shards are slices of one rank's
full tensor each; they need no broadcast to be a consistent model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.comm.mesh import RankGroups


def broadcast_replicas(params: list[torch.nn.Parameter], sharded: set[int],
                       groups: RankGroups) -> None:
    """`params` in the same order on every rank of a group; `sharded` holds the ids of the
    tensor-parallel shards."""
    mesh, c = groups.mesh, groups
    with torch.no_grad():
        if groups.tp is not None:
            src = mesh.rank(c.pp_index, c.dp_index, 0, c.cp_index)
            for p in params:
                if id(p) not in sharded:
                    dist.broadcast(p.data, src=src, group=groups.tp)
        if groups.replicas is not None:
            src = mesh.rank(c.pp_index, 0, c.tp_index, 0)
            for p in params:
                dist.broadcast(p.data, src=src, group=groups.replicas)
