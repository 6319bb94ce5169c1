"""The loss of a batch through a PipelineTrainer's own plan, forward only: the same stage
programs, mesh and micro-batches, under torch.no_grad — no backward, no gradient sync, no
optimizer step, and no state left changed (the random generators and the loss programs'
token-count buffers are put back), so a run that evaluates trains exactly as one that does not.
Under ZeRO-3 the stage programs' own gather and free calls bring each unit's parameters in
for its forward and release them after, as in training (no backward is left to gather for).

The schedule is the training schedule with its backward actions taken out: each rank runs its
forwards and their sends and receives in the training order, which keeps every rank pair's
message order and so cannot deadlock where training does not.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist

from runtime.pipeline.executor import StageExecutor
from runtime.pipeline.schedule import Kind, Schedule
from runtime.training import rng
from runtime.training.trainer import _PRECISIONS, PipelineTrainer

_FORWARD_KINDS = (Kind.F, Kind.SEND_F, Kind.RECV_F)


def forward_schedule(schedule: Schedule) -> Schedule:
    """`schedule` with only its forwards and their transfers, in the same order."""
    actions = [[a for a in row if a.kind in _FORWARD_KINDS] for row in schedule.actions]
    return Schedule(f"{schedule.name}-forward", schedule.num_ranks, schedule.num_stages,
                    schedule.num_microbatches, actions)


class _ForwardExecutor(StageExecutor):
    """A StageExecutor whose forwards keep nothing for a backward: a stage's outputs are dropped
    once sent on (or handed to the next stage on this rank), the last stage's once its loss is
    read."""

    def _forward(self, action, peer) -> None:
        super()._forward(action, peer)
        self._slots.pop((action.stage - 1, action.mb), None)  # handed over in memory
        if self.programs[action.stage].is_last:
            self._slots.pop((action.stage, action.mb))

    def _send_forward(self, action, peer) -> None:
        super()._send_forward(action, peer)
        self._slots.pop((action.stage, action.mb))


class Evaluator:
    """`loss(*global_batch)`: the mean loss of the batch under the trainer's plan, the same float
    on every rank (the training step's loss without the step)."""

    def __init__(self, trainer: PipelineTrainer):
        self.trainer = trainer
        self.schedule = forward_schedule(trainer.schedule)
        groups = trainer.groups

        def stage_rank(stage: int) -> int:
            return groups.stage_rank(self.schedule.stage_to_rank(stage))

        self.executor = _ForwardExecutor(
            trainer.programs, self.schedule, groups.rank, stage_rank,
            autocast_dtype=_PRECISIONS[trainer.options.precision], recv_ahead=0)

    def loss(self, *batch: torch.Tensor) -> float:
        t = self.trainer
        micro = t.local_microbatches(batch, self.schedule.num_microbatches)
        with _kept_state(t), torch.no_grad():
            t.tokens.before_step(micro)
            local = self.executor.run(micro)
        return _shared(t, local)


@contextlib.contextmanager
def _kept_state(trainer: PipelineTrainer):
    """Put back what a forward may change: torch's generators (dropout), the tensor-parallel
    dropout stream, and the loss programs' token-count buffers."""
    cpu, tp = torch.get_rng_state(), rng.tp_generator().get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    buffers = [getattr(trainer.programs[c.stage].gm, c.buffer) for c in trainer.tokens.counts]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        rng.tp_generator().set_state(tp)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for b, value in zip(buffers, saved):
            b.copy_(value)


def _shared(trainer: PipelineTrainer, local: torch.Tensor | None) -> float:
    """The last stage's mean over its micro-batches, averaged over replicas, sent to every rank
    of the pipeline (as the training step shares its loss)."""
    groups = trainer.groups
    value = (local.detach().float().clone() if local is not None
             else torch.zeros((), device=trainer.executor.device))
    if trainer.groups.rank == trainer.last_rank or groups.pp is None:
        if groups.replicas is not None:
            dist.all_reduce(value, group=groups.replicas)
            value /= groups.num_replicas
    if groups.pp is not None:
        dist.broadcast(value, src=trainer.last_rank, group=groups.pp)
    return float(value)


def evaluate(evaluator: Evaluator, batches: Sequence[Sequence[torch.Tensor]]) -> float:
    """The mean of the batches' losses."""
    losses = [evaluator.loss(*b) for b in batches]
    return sum(losses) / len(losses)
