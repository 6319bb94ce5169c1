"""A mean loss over the whole step's targets: what passes.rewrite.token_mean puts in the graph, and the
count the trainer sets before each step.

A cross-entropy of reduction "mean" divides by the targets that count in what it is given (those
not equal to ignore_index, weighted by their class weight). The trainer runs the loss once per
micro-batch and replica and averages the results with equal weights, which is the step's mean only
when every micro-batch counts as many targets; padded targets make them differ. The rewritten loss
is `per_token(sum, count, tokens)`: sum / tokens, where the trainer sets the buffer tokens to
N / (m·R) (N the targets that count in the whole step, m micro-batches, R replicas), so that the
equal-weight average of the m·R losses is Σ sums / N, the mean one process takes. With tokens 0
(a program run outside the trainer) it is sum / count, the mean of its own inputs as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx


def count_targets(target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None = None,
                  mean: bool = True) -> torch.Tensor:
    """What a mean cross-entropy divides by: the targets that are not ignore_index, each counted
    with its class weight (fp32, 0-d); 1 for a sum (mean=False)."""
    if not mean:
        return torch.ones((), device=target.device)
    valid = target != ignore_index
    if weight is None:
        return valid.sum().float()
    picked = weight.float()[torch.where(valid, target, 0)]
    return (picked * valid).sum()


def per_token(summed: torch.Tensor, count: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """summed / tokens once the trainer has set tokens (> 0), else summed / count."""
    return summed / torch.where(tokens > 0, tokens, count).to(summed.dtype)


@dataclass(frozen=True)
class LossCount:
    """One rewritten loss of a stage program: its buffer and the graph that counts its targets
    from a micro-batch's inputs (the nodes of the program that lead to count_targets). A sum
    has no counter: the average over m·R only has to be undone (N = 1)."""

    stage: int
    buffer: str
    counter: fx.GraphModule | None
    inputs: tuple[str, ...] = ()    # the micro-batch inputs the counter reads, by name

    def local(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        # One stack and one sum rather than m - 1 additions: each is a dispatch of its own.
        counts = [self.counter(*(mb[name] for name in self.inputs)) for mb in micro]
        return torch.stack(counts).float().sum()


# Counting every replica's targets on this rank runs the small counter graphs R·m times; the
# all-reduce of the counts that it replaces makes every replica wait for the slowest before any
# can start its forward. Up to this many runs counting here is cheaper; beyond it (hundreds of
# replicas) the collective is.
LOCAL_COUNTS = 8


class StepTokens:
    """Before each step, sets every rewritten loss's buffer on this rank to N / (m·R)."""

    def __init__(self, programs: dict, counts: tuple[LossCount, ...], replicas, num_replicas: int):
        self.programs, self.counts = programs, counts
        self.replicas, self.num_replicas = replicas, num_replicas

    def before_step(self, micro: list[dict[str, torch.Tensor]],
                    every: Callable[[], list[list[dict]]] | None = None) -> None:
        """`micro`: this rank's micro-batches. `every`, where the step has checked that every
        rank holds the same global batch: every replica's micro-batches, in one order on all
        ranks, to count without a collective when there are at most LOCAL_COUNTS of them (each
        rank then sums the same numbers in the same order, so all agree). Without it the ranks
        may hold only their own rows (fxpar train's loader), and the counts are all-reduced."""
        means = [c for c in self.counts if c.counter is not None]
        totals = {c.buffer: 1.0 for c in self.counts if c.counter is None}
        if means:
            if self.replicas is None:
                local = _count(means, micro)
            elif every is not None and self.num_replicas * len(micro) <= LOCAL_COUNTS:
                local = torch.stack([_count(means, share) for share in every()]).sum(0)
            else:  # every replica holds the same stages: one sum
                local = _count(means, micro)
                dist.all_reduce(local, group=self.replicas)
            totals.update((c.buffer, float(n)) for c, n in zip(means, local))
        for c in self.counts:
            if not totals[c.buffer] > 0:
                raise ValueError(f"no target of this step's batch counts toward the loss of "
                                 f"stage {c.stage} (every one is the loss's ignore_index): "
                                 f"its mean would be 0/0; give each batch a target to learn")
            getattr(self.programs[c.stage].gm, c.buffer).fill_(
                totals[c.buffer] / (len(micro) * self.num_replicas))


def _count(means: list[LossCount], micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Each loss's count of targets over `micro`, one tensor."""
    return torch.stack([c.local(micro) for c in means])
