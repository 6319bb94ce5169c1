"""Weight decay on the flat shards of sharded data parallel (zero 1-3), per parameter.

A shard concatenates slices of many parameters, decayed (weight matrices) and not (norms, biases,
embeddings), so no optimizer group can hold it. The shards go in the not-decayed group, each with
a mask of the elements that belong to decayed parameters, and a step pre-hook applies the decay
to those elements as the optimizer's own decay would have, before its update: AdamW's decoupled
`p *= 1 - lr * wd`, SGD's coupled `grad += wd * p`. So a run at zero 1-3 decays exactly the
parameters a run at zero 0 decays, bit for bit."""
from __future__ import annotations

from typing import Callable

import torch


def shard_mask(bucket, decayed: Callable[[str, torch.Tensor], bool]) -> torch.Tensor:
    """The elements of `bucket`'s shard (runtime.data_parallel.sharded_dp) whose parameter is
    decayed; the padding is not."""
    full = torch.zeros(bucket.padded, dtype=torch.bool)
    offset = 0
    for name, param, numel in zip(bucket.names, bucket.params, bucket.numels):
        full[offset:offset + numel] = decayed(name, param)
        offset += numel
    return full[bucket.lo:bucket.lo + bucket.shard_len].to(bucket.shard.device)


def decay_shards(optimizer: torch.optim.Optimizer, masks: dict[int, torch.Tensor],
                 weight_decay: float) -> None:
    """Register the step pre-hook: for each shard (id -> mask), the decay of its masked
    elements at its group's learning rate."""
    if not weight_decay or not any(bool(m.any()) for m in masks.values()):
        return
    coupled = isinstance(optimizer, torch.optim.SGD)

    @torch.no_grad()
    def hook(opt, _args, _kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                mask = masks.get(id(p))
                if mask is None:
                    continue
                if coupled:
                    if p.grad is not None:
                        p.grad.add_(torch.where(mask, p * weight_decay, 0.0))
                else:
                    p.copy_(torch.where(mask, p * (1 - group["lr"] * weight_decay), p))

    optimizer.register_step_pre_hook(hook)
