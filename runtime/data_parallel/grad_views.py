"""Parameters' gradients as views into one flat buffer, as gradient buckets keep them.

Two ways to fill the buffer, both used by the data-parallel buckets: views attached before
backward (autograd adds into them), or gradients left None for autograd to create and moved
into their views by a post-accumulate-grad hook (one copy instead of a zeroing and an add, as
DistributedDataParallel does)."""
from __future__ import annotations

from typing import Sequence

import torch


def flat_views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat`'s leading elements shaped as `params`, in order."""
    sizes = [p.numel() for p in params]
    return [v.view_as(p) for v, p in zip(flat[:sum(sizes)].split(sizes), params)]


def attach_views(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Every gradient its view (re-attached should anything have replaced it); the caller
    zeroes the buffer first."""
    for p, view in zip(params, views):
        if p.grad is None or not _same(p.grad, view):
            p.grad = view


def move_into_view(param: torch.Tensor, view: torch.Tensor) -> None:
    """`param`'s gradient, which autograd created, copied into its view and replaced by it,
    so that later accumulations add into the buffer; zero when it got none."""
    if param.grad is None:
        view.zero_()
    elif not _same(param.grad, view):
        view.copy_(param.grad)
    param.grad = view


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same element of one storage (by the storage object,
    which fake tensors have too, not by an address, which they have not)."""
    return a.untyped_storage() is b.untyped_storage() and a.storage_offset() == b.storage_offset()


def release(params: Sequence[torch.Tensor]) -> None:
    """Every gradient None, for autograd to create (and a hook to move in)."""
    for p in params:
        p.grad = None
