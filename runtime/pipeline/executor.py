"""Run one rank's actions of a pipeline schedule with torch.distributed point-to-point operations.

The executor walks its rank's action list once per training step. RECV_* post an irecv and SEND_*
an isend, both non-blocking, so transfers overlap with compute; a compute action waits only for
the receive it consumes, and a send is waited on (its tensor let go) once a message from the peer
proves it arrived (runtime.pipeline.send_release), else when the step ends. Receives may be
posted a little ahead of where the schedule puts them (`recv_ahead`), always in the schedule's
order, so each rank pair's receive order stays its send order.

F runs a stage program on one micro-batch, B back-propagates it, and a split backward runs I
(input gradients, what the previous stage waits for) and later W (weight gradients). Boundary
tensors are detached on arrival and marked requires_grad, so each (stage, micro-batch) owns a
separate autograd graph whose input gradients are what SEND_B ships upstream.

Split backward: I calls torch.autograd.grad towards the boundary inputs with the graph retained.
By default ("retraverse") W then runs backward from the stage's outputs towards the parameters
only; autograd keeps no intermediate gradients between the two calls, so W walks again the part
of the graph on both paths (for a transformer block, the residual stream's gradients): up to
about one more input-gradient pass per micro-batch. With split_backward="record"
(runtime.pipeline.split_backward) I records the gradient arriving where each parameter's path
joins the input's and W starts from those records, running only the weights' halves of those
nodes; the records, about the size of a micro-batch's activations, live from I until W. A
stage with recomputed layers retraverses all the same: W's backwards from the records are graph
tasks of their own, and non-reentrant checkpointing recomputes a region once per task. Either
way the activations live until W, not until I, and the gradients are those of a full backward.
Stage 0 has no boundary input, so its I is free and its W is a plain backward.

Every wait is wrapped: a peer that died (or hangs past the process-group timeout) surfaces as a
PeerError naming this rank, the action and the peer, instead of a hang or a bare transport error.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from runtime.programs.stage import StageProgram
from runtime.launch import activity
from runtime.pipeline.schedule import Action, Kind, Schedule
from runtime.pipeline.send_release import releases
from runtime.pipeline.simulator import Event, Timeline
from runtime.pipeline.split_backward import Deferred, input_backward, recomputes, weight_backward

_MAX_TENSORS = 64  # tensors per boundary message; part of the p2p tag arithmetic
_NOTHING = contextlib.nullcontext()  # a forward with no context to enter


class PeerError(RuntimeError):
    """A wait on another rank failed: the message names this rank, the action and the peer."""


def wait_or_explain(works, what: str | Callable[[], str]) -> None:
    """Wait for `works`; on failure raise PeerError saying what this rank was waiting for
    (`what` may be a function, so the message is only built when needed)."""
    with explained(what):
        for work in works:
            work.wait()


@contextlib.contextmanager
def explained(what: str | Callable[[], str]):
    """Turn a failure of the operations with peers inside into a PeerError: gloo fails a send
    or receive already where it is posted when the peer is gone."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - backends raise assorted types, all mean this
        raise peer_error(err, what) from err


def peer_error(err: Exception, what: str | Callable[[], str]) -> PeerError:
    """The PeerError saying that what this rank was doing with a peer failed, and why."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    what = what() if callable(what) else what
    return PeerError(f"{what} failed: {reason}. The peer rank probably died or is stuck; "
                     "look for its own error above or in its log")


@dataclass
class _Slot:
    """What one (stage, micro-batch) keeps from its forward until its backward is done."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    roots: list[torch.Tensor] | None = None  # set by I: where W starts its backward from
    root_grads: list[torch.Tensor] | None = None
    deferred: Deferred | None = None  # set by I: W's part (runtime.pipeline.split_backward)


@dataclass(frozen=True)
class _Step:
    """One action, resolved once: its handler, the peer's global rank, and the stage whose
    last gradient-producing action of the step this is (None otherwise)."""

    run: Callable
    action: Action
    peer: int | None
    finishes_stage: int | None
    recv_index: int | None  # position among this rank's receives, for RECV_* actions
    compute: bool
    doing: str  # what runtime.launch.activity says while it runs, built once


class StageExecutor:
    """Executes one rank's actions of `schedule` for the stage programs this rank holds.

    `stage_rank(stage)` gives the global rank holding a stage of this rank's pipeline.
    `autocast_dtype` turns on mixed precision for the forwards; `memory` (a
    runtime.training.activation_memory.SavedActivations) counts the tensors autograd saves, per stage.

    `recv_ahead`: receives are posted up to this many ahead of the one being consumed, in the
    schedule's order (so each rank pair's order is kept), not only where the schedule places
    them. With gloo a send moves data only once its receive is posted, so an early post lets the
    transfer run while this rank computes; each costs one boundary-sized buffer held early.
    0 posts receives exactly where the schedule does.

    `split_backward`: "retraverse" (W is a backward from the stage's outputs to the weights,
    walking again the path I took) or "record" (runtime.pipeline.split_backward: W starts from
    the gradients I recorded where the weights' paths join the input's).
    """

    def __init__(self, programs: dict[int, StageProgram], schedule: Schedule, rank: int,
                 stage_rank: Callable[[int], int], *, autocast_dtype: torch.dtype | None = None,
                 memory=None, recv_ahead: int = 2, split_backward: str = "retraverse"):
        self.programs = programs
        self.schedule = schedule
        self.rank = rank
        self.stage_rank = stage_rank
        self.pp_rank = schedule.stage_to_rank(min(programs))
        if set(programs) != set(schedule.stages_of(self.pp_rank)):
            raise ValueError(f"rank {rank} holds stages {sorted(programs)}, but the schedule "
                             f"places stages {schedule.stages_of(self.pp_rank)} on it")
        self.actions = schedule.actions[self.pp_rank]
        self.autocast_dtype = autocast_dtype
        self.memory = memory
        self.recv_ahead = recv_ahead
        # A checkpointed region would be recomputed once per backward W runs from its records
        # (each is a graph task of its own), so stages holding one retraverse: one recompute.
        self.record = {s for s, prog in programs.items()
                       if split_backward == "record" and not recomputes(prog.gm)}
        first = next(iter(programs.values())).gm
        self.device = next((p.device for p in first.parameters()), torch.device("cpu"))
        self.params = {s: [p for p in prog.gm.parameters() if p.requires_grad]
                       for s, prog in programs.items()}
        self._float_inputs = {s: [spec.floating for spec in prog.input_specs]
                              for s, prog in programs.items()}
        self._steps = self._compile()
        self._accumulators: dict = {}  # parameters' AccumulateGrad nodes, for the split backward
        self.events: list[Event] = []
        self.waits: list[tuple[str, float, float]] = []
        self.sharding = None  # runtime.data_parallel.sharded_dp.ShardedDP, set by the trainer

    # -- set-up -----------------------------------------------------------------------------
    def _compile(self) -> list[_Step]:
        handlers = {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._backward_input,
                    Kind.W: self._backward_weight, Kind.RECV_F: self._recv_forward,
                    Kind.RECV_B: self._recv_backward, Kind.SEND_F: self._send_forward,
                    Kind.SEND_B: self._send_backward}
        last_grad = {a.stage: i for i, a in enumerate(self.actions) if a.kind in (Kind.B, Kind.W)}
        finishing = {i: stage for stage, i in last_grad.items()}
        steps, receives = [], 0
        for i, action in enumerate(self.actions):
            other = self.schedule.counterpart(action)  # the peer's matching SEND/RECV
            peer = None if other is None else self.stage_rank(other.stage)
            is_recv = action.kind in (Kind.RECV_F, Kind.RECV_B)
            doing = (f"action {action} (to rank {peer})" if action.kind.is_send else
                     f"action {action}")
            steps.append(_Step(handlers[action.kind], action, peer, finishing.get(i),
                               receives if is_recv else None, action.kind.is_compute, doing))
            receives += is_recv
        self._recv_steps = [step for step in steps if step.recv_index is not None]
        self._released_by = releases(self.schedule, self.pp_rank)
        return steps

    # -- one training step ------------------------------------------------------------------
    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_multiplier: float | None = None,
            on_stage_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """One pass over the schedule. The backward starts from loss x `loss_multiplier`
        (default 1/m: the mean over micro-batches). `on_stage_done(stage)` is called as soon as
        a stage's gradients for this step are complete. Returns the mean loss over micro-batches
        on the rank holding the last stage, else None."""
        self._data = microbatches
        self._multiplier = 1.0 / len(microbatches) if loss_multiplier is None else loss_multiplier
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._recvs: dict[Action, tuple[list, list[torch.Tensor], int]] = {}
        self._input_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._sends: dict[Action, tuple[int, list]] = {}  # unwaited sends: (peer, works)
        self._losses: list[torch.Tensor] = []
        self._posted = 0  # receives posted so far, in schedule order
        self.events = []
        self.waits: list[tuple[str, float, float]] = []  # (what, start, end) of p2p waits
        receives, ahead, sharding = len(self._recv_steps), self.recv_ahead, self.sharding
        for step in self._steps:
            if step.recv_index is not None:  # posted here unless posted ahead already
                self._post_receives(step.recv_index + 1)
                continue
            if ahead and step.compute and self._posted < receives:
                self._post_receives(self._posted + ahead - len(self._recvs))
            activity.now(step.doing)
            step.run(step.action, step.peer)
            if sharding is not None and step.compute:
                sharding.action_done(step.action)
            if step.finishes_stage is not None and on_stage_done is not None:
                on_stage_done(step.finishes_stage)
        activity.now("the end of the schedule (waiting for sends)")
        start = time.perf_counter()
        for send in list(self._sends):
            self._finish_send(send)
        self.waits.append(("sends", start, time.perf_counter()))
        if self._slots or self._recvs:
            raise RuntimeError(f"rank {self.rank}: schedule left work behind: "
                               f"{sorted(self._slots)} {sorted(map(str, self._recvs))}")
        return torch.stack(self._losses).mean() if self._losses else None

    def timeline(self) -> Timeline:
        """Compute actions of the last step on this rank, timed with time.perf_counter (a
        system-wide clock on Linux, so ranks of one host share it)."""
        return Timeline.from_events(self.events)

    # -- communication ----------------------------------------------------------------------
    def _tag(self, boundary: int, mb: int, direction: int, index: int) -> int:
        """Messages across boundary (s, s+1) are tagged with s; gloo matches on tags, NCCL
        ignores them and relies on the schedule's per-pair order."""
        return ((mb * self.schedule.num_stages + boundary) * 2 + direction) * _MAX_TENSORS + index

    def _post_receives(self, upto: int) -> None:
        """Post this rank's receives in schedule order until `upto` of them are posted."""
        while self._posted < min(upto, len(self._recv_steps)):
            step = self._recv_steps[self._posted]
            step.run(step.action, step.peer)
            self._posted += 1

    def _post_recv(self, action: Action, peer: int, specs, boundary: int, direction: int) -> None:
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        tag = self._tag(boundary, action.mb, direction, 0)
        try:  # not `explained`: a context manager per receive costs more than the rest
            works = [dist.irecv(b, src=peer, tag=tag + i) for i, b in enumerate(bufs)]
        except Exception as err:  # noqa: BLE001 - see explained
            raise peer_error(err, f"rank {self.rank} waiting for {action} from rank "
                                  f"{peer}") from err
        self._recvs[action] = (works, bufs, peer)

    def _take(self, action: Action) -> list[torch.Tensor]:
        works, bufs, peer = self._recvs.pop(action)
        activity.detail(f"recv from rank {peer}")
        start = time.perf_counter()
        wait_or_explain(works, lambda: f"rank {self.rank} waiting for {action} from rank {peer}")
        self.waits.append((str(action), start, time.perf_counter()))
        for send in self._released_by.get(action, ()):
            if send in self._sends:
                self._finish_send(send)
        return bufs

    def _post_send(self, action: Action, peer: int, tensors, boundary: int, direction: int):
        tag = self._tag(boundary, action.mb, direction, 0)
        posted = []
        self._sends[action] = (peer, posted)
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            try:  # not `explained`, as in _post_recv
                posted.append((dist.isend(t, dst=peer, tag=tag + i), t))
            except Exception as err:  # noqa: BLE001 - see explained
                raise peer_error(err, f"rank {self.rank} sending {action} to rank {peer}") from err

    def _finish_send(self, action: Action) -> None:
        """Wait on a send (runtime.pipeline.send_release says when: it has completed by then)
        and let go of its tensors; the wait surfaces a failed send."""
        peer, posted = self._sends.pop(action)
        wait_or_explain([work for work, _ in posted],
                        lambda: f"rank {self.rank} waiting for {action} to rank {peer} to complete")

    def _recv_forward(self, action: Action, peer: int) -> None:
        specs = self.programs[action.stage].input_specs
        self._post_recv(action, peer, specs, action.stage - 1, 0)

    def _recv_backward(self, action: Action, peer: int) -> None:
        specs = [s for s in self.programs[action.stage].output_specs if s.floating]
        self._post_recv(action, peer, specs, action.stage, 1)

    def _send_forward(self, action: Action, peer: int) -> None:
        outputs = self._slots[action.stage, action.mb].outputs
        self._post_send(action, peer, outputs, action.stage, 0)

    def _send_backward(self, action: Action, peer: int) -> None:
        grads = self._input_grads.pop((action.stage, action.mb))
        self._post_send(action, peer, grads, action.stage - 1, 1)

    # -- compute ----------------------------------------------------------------------------
    def _forward(self, action: Action, _peer) -> None:
        stage, mb = action.stage, action.mb
        program = self.programs[stage]
        if not program.boundary_inputs:
            inputs = []
        else:
            recv = Action(stage, Kind.RECV_F, mb)
            if recv in self._recvs:
                inputs = self._take(recv)
            else:  # the previous stage lives on this rank: hand over in memory
                inputs = [t.detach() for t in self._slots[stage - 1, mb].outputs]
            for t, floating in zip(inputs, self._float_inputs[stage]):
                t.requires_grad_(floating)
        data = [self._data[mb][name] for name in program.data_inputs]
        start = time.perf_counter()
        with self._forward_context(stage, data):
            out = program.gm(*inputs, *data)
        slot = _Slot(inputs)
        if program.is_last:
            slot.loss = out[0] if isinstance(out, (tuple, list)) else out
            self._losses.append(slot.loss.detach().float())
        else:
            # Under autocast an output may come out in another dtype than the captured one; the
            # receiver allocates by the captured spec, so cast back (autograd casts the gradient).
            slot.outputs = [t if t.dtype == s.dtype else t.to(s.dtype)
                            for t, s in zip(out, program.output_specs)]
        self._slots[stage, mb] = slot
        self.events.append(Event(self.pp_rank, action, start, time.perf_counter()))

    def _forward_context(self, stage: int, data):
        if self.autocast_dtype is None and self.memory is None and self.sharding is None:
            return _NOTHING
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        if self.memory is not None:
            stack.enter_context(self.memory.saving(stage, ignore=data))
        if self.sharding is not None:  # sharded parameters are gathered again for backward
            stack.enter_context(self.sharding.saving())
        return stack

    def _roots(self, stage: int, mb: int, slot: _Slot):
        """(tensors, gradients) the backward of (stage, mb) starts from; waits for RECV_B."""
        if slot.loss is not None:
            return [slot.loss], [torch.full_like(slot.loss, self._multiplier)]
        recv = Action(stage, Kind.RECV_B, mb)
        if recv in self._recvs:
            grads = self._take(recv)
        else:  # the next stage lives on this rank
            grads = self._input_grads.pop((stage + 1, mb))
        floats = [t for t in slot.outputs if t.dtype.is_floating_point]
        pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _keep_input_grads(self, stage: int, mb: int, grads) -> None:
        if stage > 0:  # stage 0 has no boundary input: nothing goes upstream
            self._input_grads[stage, mb] = grads

    def _backward(self, action: Action, _peer) -> None:
        stage, mb = action.stage, action.mb
        slot = self._slots.pop((stage, mb))
        roots, grads = self._roots(stage, mb, slot)
        start = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, grads)
        self._keep_input_grads(stage, mb, [t.grad if t.grad is not None else torch.zeros_like(t)
                                           for t in slot.inputs if t.dtype.is_floating_point])
        self.events.append(Event(self.pp_rank, action, start, time.perf_counter()))

    def _backward_input(self, action: Action, _peer) -> None:
        stage, mb = action.stage, action.mb
        slot = self._slots[stage, mb]
        slot.roots, slot.root_grads = self._roots(stage, mb, slot)
        start = time.perf_counter()
        floats = [t for t in slot.inputs if t.dtype.is_floating_point]
        wanted = [t for t in floats if t.requires_grad]
        got = {}
        if wanted and slot.roots and stage in self.record:
            grads, slot.deferred = input_backward(slot.roots, slot.root_grads, wanted,
                                                  self.params[stage], self._accumulators)
            got = {id(t): g for t, g in zip(wanted, grads) if g is not None}
        elif wanted and slot.roots:
            grads = torch.autograd.grad(slot.roots, wanted, slot.root_grads, retain_graph=True,
                                        allow_unused=True)
            got = {id(t): g for t, g in zip(wanted, grads) if g is not None}
        self._keep_input_grads(stage, mb, [got[id(t)] if id(t) in got else torch.zeros_like(t)
                                           for t in floats])
        self.events.append(Event(self.pp_rank, action, start, time.perf_counter()))

    def _backward_weight(self, action: Action, _peer) -> None:
        slot = self._slots.pop((action.stage, action.mb))
        start = time.perf_counter()
        params = self.params[action.stage]
        if slot.deferred is not None:
            weight_backward(slot.deferred)
        elif slot.roots and params:  # retraverse, or no input gradient was wanted
            torch.autograd.backward(slot.roots, slot.root_grads, inputs=params)
        self.events.append(Event(self.pp_rank, action, start, time.perf_counter()))

