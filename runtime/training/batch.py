"""What `train_step` must be given, checked before any rank sends a byte.

Every rank's stage programs were captured at the plan's micro-batch shapes, and receivers allocate
boundary buffers by them: a batch of another size would make one rank's transfer disagree with
its peer's, which gloo reports minutes later as an abort that names no cause. So the global batch
is checked against the plan on every rank (a clear error at once, the same on all of them), and
the ranks compare a fingerprint of what they were given, since `train_step` takes the same global
batch on every rank and each replica takes its own share of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BatchSpec:
    """Per input: its name, its shape (the global batch first) and dtype; `split` says how the
    plan cuts the global batch (for the message)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    split: str = ""

    @classmethod
    def of(cls, names: Sequence[str], example: Sequence[torch.Tensor], global_batch: int,
           split: str = "") -> "BatchSpec":
        shapes = tuple((global_batch, *x.shape[1:]) for x in example)
        return cls(tuple(names), shapes, tuple(x.dtype for x in example), split)

    def check(self, batch: Sequence) -> None:
        if len(batch) != len(self.names):
            raise ValueError(f"train_step got {len(batch)} inputs; the plan's model takes "
                             f"{len(self.names)} ({', '.join(self.names)})")
        for i, (name, x, shape, dtype) in enumerate(zip(self.names, batch, self.shapes,
                                                        self.dtypes)):
            name = f"{i} ({name})"
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"train_step input {name} is a {type(x).__name__}, not a tensor")
            if tuple(x.shape) != shape:
                hint = (f"pass {shape[0]} samples, or plan again for a global batch of "
                        f"{x.shape[0]}" if x.shape[1:] == shape[1:] else
                        "the model was captured at that shape: plan again for the new one")
                raise ValueError(f"train_step input {name} has shape {list(x.shape)}; the plan "
                                 f"expects {list(shape)} (global batch {shape[0]}"
                                 f"{' = ' + self.split if self.split else ''}): {hint}")
            if x.dtype != dtype:
                raise TypeError(f"train_step input {name} is {x.dtype}; the model was captured "
                                f"with {dtype}")


def fingerprint(batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """[f, -f] for a position-weighted sum f of every input, to be all-reduced with MAX: the
    ranks were given the same batch when the result is [f, -f] again."""
    total = torch.zeros((), dtype=torch.float64)
    for x in batch:
        flat = x.detach().flatten().to(device="cpu", dtype=torch.float64)
        total += (flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64)).sum()
    return torch.stack([total, -total])


def compare_batches(batch: Sequence[torch.Tensor]) -> None:
    """Raise on every rank unless every rank was given the same batch (one small all-reduce).
    It runs before any other collective of the step: a step refused later would leave posted
    collectives behind, which the next step's would pair with."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    value = fingerprint(batch)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    if not torch.isclose(value[0], -value[1], rtol=1e-12, atol=0.0):
        raise ValueError("train_step was given different batches on different ranks: pass the "
                         "same global batch on every rank (each data-parallel replica takes its "
                         "own share of it)")
