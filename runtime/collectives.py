"""Collectives that rewrite passes insert into FX graphs as named call nodes.

A graph refers to a process group by a short name ("tp", "dp", ...) rather than holding a
ProcessGroup object, so the same graph text prints readably and runs on every rank; the runtime
binds names to this rank's groups with `bind_groups`. Each function carries `_fxpar_collective`
(the kind priced by the cost model) and records the bytes it sends in `TRAFFIC`, per layer tag.

Outside a process group, or on fake/meta tensors (shape propagation, pricing), they are identities.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup] = {}
# (kind, layer tag) -> bytes this rank sent; read by tests and the cost-model validation.
TRAFFIC: dict[tuple[str, str], int] = defaultdict(int)


def bind_groups(**groups: dist.ProcessGroup | None) -> None:
    for name, group in groups.items():
        if group is None:
            _GROUPS.pop(name, None)
        else:
            _GROUPS[name] = group


def group_size(name: str) -> int:
    group = _GROUPS.get(name)
    return dist.get_world_size(group) if group is not None else 1


def _active(x: torch.Tensor, name: str) -> bool:
    if x.is_meta or type(x).__name__ == "FakeTensor" or not dist.is_initialized():
        return False
    return group_size(name) > 1


def _all_reduce(x: torch.Tensor, name: str, tag: str) -> torch.Tensor:
    n = group_size(name)
    TRAFFIC[("all_reduce", tag)] += 2 * (n - 1) * x.numel() * x.element_size() // n
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_GROUPS[name])
    return out


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, name, tag):
        ctx.name, ctx.tag = name, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.name, ctx.tag), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, name, tag):
        return _all_reduce(x, name, tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def tp_copy(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """Enter a tensor-parallel region (the gradient is all-reduced on the way back)."""
    return _CopyToRegion.apply(x, group, tag) if _active(x, group) else x


def tp_all_reduce(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial results of a row-parallel linear."""
    return _ReduceFromRegion.apply(x, group, tag) if _active(x, group) else x


tp_copy._fxpar_collective = "all_reduce_backward"
tp_all_reduce._fxpar_collective = "all_reduce"
