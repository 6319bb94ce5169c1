"""Run a pipeline schedule on this rank with torch.distributed point-to-point operations.

The executor walks its rank's action list: RECV_* post irecv, SEND_* post isend (both overlap with
compute), F runs a stage program on one micro-batch, B back-propagates it. Boundary tensors are
detached on arrival and marked requires_grad, so each stage owns a separate autograd graph whose
input gradients are what SEND_B ships upstream. A timeline of (action, start, end) is recorded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from passes.pipeline_split import StageProgram
from runtime.schedule import Action, Kind, Schedule

_MAX_TENSORS = 64  # tensors per boundary; part of the p2p tag arithmetic


@dataclass
class _MicroBatchState:
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    input_grads: list[torch.Tensor] = field(default_factory=list)


class StageExecutor:
    """Executes one rank's actions of `schedule` for the stage programs this rank holds."""

    def __init__(self, programs: dict[int, StageProgram], schedule: Schedule, rank: int,
                 stage_rank, pp_group=None):
        self.programs = programs
        self.schedule = schedule
        self.rank = rank
        self.stage_rank = stage_rank  # stage -> global rank
        self.actions = schedule.actions[schedule.stage_to_rank(min(programs))]
        self.timeline: list[tuple[Action, float, float]] = []

    def run(self, microbatches: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        """One pass over the schedule; returns the mean loss over micro-batches on the last stage."""
        self.timeline.clear()
        self._state = {}
        self._recvs: dict[tuple[int, Kind, int], tuple[list, list[torch.Tensor]]] = {}
        self._sends: list = []
        self._local_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._data = microbatches
        losses = []
        for action in self.actions:
            start = time.perf_counter()
            loss = self._do(action)
            if loss is not None:
                losses.append(loss)
            self.timeline.append((action, start, time.perf_counter()))
        for work in self._sends:
            work.wait()
        return torch.stack(losses).mean() if losses else None

    def _do(self, action: Action):
        kind, stage, mb = action.kind, action.stage, action.mb
        if kind is Kind.RECV_F:
            self._post_recv(action, self.programs[stage].input_specs, stage - 1, direction=0)
        elif kind is Kind.RECV_B:
            specs = [s for s in self.programs[stage].output_specs if s.floating]
            self._post_recv(action, specs, stage + 1, direction=1)
        elif kind is Kind.SEND_F:
            self._post_send(self._state[stage, mb].outputs, stage + 1, stage, mb, direction=0)
        elif kind is Kind.SEND_B:
            self._post_send(self._state[stage, mb].input_grads, stage - 1, stage - 1, mb, 1)
        elif kind is Kind.F:
            return self._forward(stage, mb)
        elif kind in (Kind.B, Kind.I):
            self._backward(stage, mb)
        elif kind is Kind.W:
            pass  # weight gradients were accumulated by the full backward in _backward
        return None

    def _tag(self, stage: int, mb: int, direction: int, index: int) -> int:
        return ((mb * self.schedule.num_stages + stage) * 2 + direction) * _MAX_TENSORS + index

    def _post_recv(self, action, specs, peer_stage, direction):
        # Tags are keyed by the sending side's stage for forward and receiving side's for backward
        tag_stage = action.stage - 1 if direction == 0 else action.stage
        bufs = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
        works = [dist.irecv(b, src=self.stage_rank(peer_stage),
                            tag=self._tag(tag_stage, action.mb, direction, i))
                 for i, b in enumerate(bufs)]
        self._recvs[action.stage, action.kind, action.mb] = (works, bufs)

    def _post_send(self, tensors, peer_stage, tag_stage, mb, direction):
        for i, t in enumerate(tensors):
            self._sends.append(dist.isend(t.detach().contiguous(), dst=self.stage_rank(peer_stage),
                                          tag=self._tag(tag_stage, mb, direction, i)))

    def _take(self, stage: int, kind: Kind, mb: int) -> list[torch.Tensor]:
        works, bufs = self._recvs.pop((stage, kind, mb))
        for work in works:
            work.wait()
        return bufs

    def _forward(self, stage: int, mb: int):
        program = self.programs[stage]
        if program.boundary_inputs:
            if (stage, Kind.RECV_F, mb) in self._recvs:
                received = self._take(stage, Kind.RECV_F, mb)
            else:  # previous stage on this rank: hand over in memory
                received = [t.detach() for t in self._state[stage - 1, mb].outputs]
            inputs = [t.requires_grad_(s.floating) for t, s in zip(received, program.input_specs)]
        else:
            inputs = []
        data = [self._data[mb][name] for name in program.data_inputs]
        out = program.gm(*inputs, *data)
        state = _MicroBatchState(inputs=inputs)
        if program.is_last:
            state.loss = out[0] if isinstance(out, (tuple, list)) else out
            self._state[stage, mb] = state
            return state.loss.detach()
        state.outputs = list(out)
        self._state[stage, mb] = state
        return None

    def _backward(self, stage: int, mb: int):
        state = self._state.pop((stage, mb))
        if state.loss is not None:
            torch.autograd.backward(state.loss / len(self._data))
        else:
            if (stage, Kind.RECV_B, mb) in self._recvs:
                grads = self._take(stage, Kind.RECV_B, mb)
            else:
                grads = self._local_grads.pop((stage + 1, mb))
            floats = [t for t in state.outputs if t.dtype.is_floating_point]
            pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in state.inputs if t.dtype.is_floating_point]
        if stage - 1 in self.programs:
            self._local_grads[stage, mb] = grads
        else:  # keep only what SEND_B needs; the activations are freed here
            self._state[stage, mb] = _MicroBatchState(input_grads=grads)
