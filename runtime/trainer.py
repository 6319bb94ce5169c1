"""One training iteration on this rank: micro-batches through the pipeline schedule, data-parallel
gradient all-reduce, optimizer step, and the loss made known to every rank."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from passes.pipeline_split import StageProgram
from runtime.executor import StageExecutor
from runtime.mesh import RankGroups
from runtime.schedule import Schedule

_BUCKET_BYTES = 25 * 2**20


def split_batch(batch: Sequence[torch.Tensor], names: Sequence[str], dp: int, dp_index: int,
                microbatches: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the global batch, cut into equal micro-batches."""
    size = batch[0].shape[0]
    if size % (dp * microbatches):
        raise ValueError(f"global batch {size} is not divisible by dp={dp} x "
                         f"micro-batches={microbatches}")
    local = [t.chunk(dp)[dp_index] for t in batch]
    return [dict(zip(names, parts)) for parts in zip(*(t.chunk(microbatches) for t in local))]


class PipelineTrainer:
    def __init__(self, programs: dict[int, StageProgram], schedule: Schedule, groups: RankGroups,
                 input_names: Sequence[str],
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.programs = programs
        self.schedule = schedule
        self.groups = groups
        self.input_names = tuple(input_names)
        self.params = [p for prog in programs.values() for p in prog.gm.parameters()
                       if p.requires_grad]
        self.optimizer = optimizer(self.params)
        stage_rank = lambda stage: groups.stage_rank(schedule.stage_to_rank(stage))  # noqa: E731
        self.executor = StageExecutor(programs, schedule, groups.rank, stage_rank)
        self.last_rank = stage_rank(schedule.num_stages - 1)

    def step(self, *batch: torch.Tensor) -> float:
        mesh = self.groups.mesh
        micro = split_batch(batch, self.input_names, mesh.dp, self.groups.dp_index,
                            self.schedule.num_microbatches)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.executor.run(micro)
        self._sync_gradients()
        self.optimizer.step()
        return self._share_loss(loss)

    def _sync_gradients(self) -> None:
        """Average gradients over data-parallel replicas, a bucket of flat tensors at a time."""
        if self.groups.dp is None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        bucket: list[torch.Tensor] = []
        for grad in grads + [None]:
            if grad is not None:
                bucket.append(grad)
            full = sum(g.numel() * g.element_size() for g in bucket) >= _BUCKET_BYTES
            if bucket and (grad is None or full):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=self.groups.dp)
                flat /= self.groups.mesh.dp
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(part.view_as(g))
                bucket = []

    def _share_loss(self, loss: torch.Tensor | None) -> float:
        value = torch.zeros(()) if loss is None else loss.detach().clone().float()
        if self.groups.dp is not None and loss is not None:
            dist.all_reduce(value, group=self.groups.dp)
            value /= self.groups.mesh.dp
        if self.groups.pp is not None:
            dist.broadcast(value, src=self.last_rank, group=self.groups.pp)
        return float(value)
