"""Collectives that rewrite passes insert into FX graphs as named call nodes.

A graph refers to a process group by a short name ("tp", "dp", ...) rather than holding a
ProcessGroup object, so the same graph text prints readably and runs on every rank; the runtime
binds names to this rank's groups with `bind_groups`. Each function carries `_fxpar_collective`
(the kind priced by the cost model; a "_backward" suffix when it communicates only in backward) and
records the bytes it sends in `TRAFFIC`, per layer tag, with `runtime.comm.wire.bytes_on_wire`
semantics, so a measured count can be compared with the cost model exactly.

Communication repeated to save memory (a checkpointed region run again in backward, the all-gather
a sequence-parallel linear redoes instead of keeping its gathered input) is counted apart, in
`RECOMPUTE_TRAFFIC`: the cost model prices each collective once.

Tensor-parallel (Megatron f / g):
  tp_copy        identity forward, all-reduce of the gradient backward (enter a TP region)
  tp_all_reduce  all-reduce forward, identity backward (leave it: sum row-parallel partials)
  tp_grad_sum    as tp_copy, for a replicated weight whose gradient each rank holds only in part
  tp_grad_share  identity forward, the gradient divided by the group's size backward (no
                 communication): a full gradient made a share for a tp_sum to sum
  tp_gather      all-gather forward, this rank's block of the (replicated) gradient backward:
                 a column-parallel output needed whole (passes.rewrite.tp_gather)
  tp_sum         all-reduce forward and all-reduce of the gradient backward: a sum over the
                 sharded features (a norm's statistics over all heads), which every rank then
                 applies to its own shard, so each holds only its part of the sum's gradient
Sequence-parallel (along `dim`, the sequence dimension of [batch, seq, hidden]):
  sp_all_gather      all-gather forward, reduce-scatter backward (enter a TP region)
  sp_reduce_scatter  reduce-scatter forward, all-gather backward (leave it)
  sp_scatter         keep this rank's slice forward, all-gather backward (replicated -> sharded)
  sp_gather          all-gather forward, keep this rank's slice backward (sharded -> replicated)
  sp_gather_linear   sp_all_gather fused with the column-parallel linears reading its output; it
                     keeps only the local slice for backward and gathers it again there
Statistics of a split sequence:
  group_sum      all-reduce (sum) forward and all-reduce of the gradient backward: every rank
                 holds the group's sum and feeds it to its own loss, which the trainer averages
                 over the group, so the summed gradient is what one process computes (the
                 mixture-of-experts balance statistics under context parallelism)

Outside a process group, or on fake/meta tensors (shape propagation, pricing), they compute shapes
only: the TP ones are identities, the SP ones change dimension `dim` by the factor `parts`.
"""
from __future__ import annotations

import contextlib

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.programs.token_split import unshard_sequence
from runtime.comm.wire import bytes_on_wire

_GROUPS: dict[str, dist.ProcessGroup] = {}
# (kind, layer tag) -> bytes this rank sent; read by tests and the cost-model validation.
TRAFFIC: dict[tuple[str, str], float] = defaultdict(float)
RECOMPUTE_TRAFFIC: dict[tuple[str, str], float] = defaultdict(float)
_recomputing = [False]
# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bind_groups(**groups: dist.ProcessGroup | None) -> None:
    for name, group in groups.items():
        if group is None:
            _GROUPS.pop(name, None)
        else:
            _GROUPS[name] = group


def group_size(name: str) -> int:
    group = _GROUPS.get(name)
    return dist.get_world_size(group) if group is not None else 1


class recomputing:
    """Count the collectives run inside as repeated communication (RECOMPUTE_TRAFFIC).
    Re-enterable: a checkpoint re-enters its recompute context once per backward pass (twice when
    input and weight gradients are computed apart)."""

    def __enter__(self):
        self.previous, _recomputing[0] = _recomputing[0], True

    def __exit__(self, *exc):
        _recomputing[0] = self.previous


def count_traffic(kind: str, tag: str, nbytes: int, n: int) -> None:
    """Add what one rank puts on the wire for this collective to the layer's counter (the
    recompute counter inside a recomputation)."""
    table = RECOMPUTE_TRAFFIC if _recomputing[0] else TRAFFIC
    table[(kind, tag)] += bytes_on_wire(kind, nbytes, n)


def _fake(x: torch.Tensor) -> bool:
    """A tensor of shapes only (meta, or fake while a model is captured or profiled): nothing to
    communicate. In a dry run (`fake_run`) fake tensors are the run's own and communicate
    through its fake process group, so that the collectives allocate what they would."""
    return x.is_meta or (type(x).__name__ == "FakeTensor" and not _FAKE_RUN[0])


_FAKE_RUN = [False]
_DRY_BACKEND = ["nccl"]   # the backend a dry run stands in for


def dry_running() -> bool:
    """Whether a dry run (`fake_run`) is on: tensors hold shapes, not values."""
    return _FAKE_RUN[0]


def backend(group) -> str:
    """The backend of `group`'s collectives: torch.distributed's, or in a dry run the one the
    plan will run on (its fake process group stands in for it)."""
    return _DRY_BACKEND[0] if _FAKE_RUN[0] else dist.get_backend(group)


@contextlib.contextmanager
def fake_run(backend: str = "nccl"):
    """Fake tensors are a dry run's (planner.bench.dry_run): collectives and recomputation
    run on them as on real ones, as `backend` runs them."""
    previous = _FAKE_RUN[0], _DRY_BACKEND[0]
    _FAKE_RUN[0], _DRY_BACKEND[0] = True, backend
    try:
        yield
    finally:
        _FAKE_RUN[0], _DRY_BACKEND[0] = previous


def _active(x: torch.Tensor, name: str) -> bool:
    if _fake(x) or not dist.is_initialized():
        return False
    return group_size(name) > 1


def _check_parts(x: torch.Tensor, name: str, parts: int) -> bool:
    """Whether to communicate; a real tensor that needs a group it does not have is an error."""
    if _fake(x) or parts == 1:
        return False
    if not dist.is_initialized() or group_size(name) != parts:
        raise RuntimeError(f"collective over {parts} ranks of group '{name}' but the bound group "
                           f"has {group_size(name)} (runtime.comm.collectives.bind_groups)")
    return True


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def all_reduce(x: torch.Tensor, name: str, tag: str, op: str = "sum") -> torch.Tensor:
    """A counted all-reduce of a copy of x (no autograd): op is "sum" or "max"."""
    n = group_size(name)
    count_traffic("all_reduce", tag, _nbytes(x), n)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                    group=_GROUPS[name])
    return out


def _gather(x: torch.Tensor, name: str, tag: str, dim: int) -> torch.Tensor:
    n = group_size(name)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # the pieces one after another on dim 0
    _all_gather_single(out, x, group=_GROUPS[name])
    count_traffic("all_gather", tag, _nbytes(out), n)
    return out.unflatten(0, (n, -1)).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, name: str, tag: str, dim: int) -> torch.Tensor:
    n = group_size(name)
    stacked = x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(stacked.shape[1:])
    _reduce_scatter_single(out, stacked.flatten(0, 1), group=_GROUPS[name])
    count_traffic("reduce_scatter", tag, _nbytes(x), n)
    return out


def _take(x: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    index = dist.get_rank(_GROUPS[name])
    return x.chunk(group_size(name), dim)[index].clone(memory_format=torch.contiguous_format)


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, name, tag):
        ctx.name, ctx.tag = name, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.name, ctx.tag), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, name, tag):
        return all_reduce(x, name, tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def tp_copy(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """Enter a tensor-parallel region (the gradient is all-reduced on the way back)."""
    return _CopyToRegion.apply(x, group, tag) if _active(x, group) else x


def tp_all_reduce(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial results of a row-parallel linear."""
    return _ReduceFromRegion.apply(x, group, tag) if _active(x, group) else x


def tp_grad_sum(w: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """A replicated weight used differently on each rank: sum its gradient over the group."""
    return _CopyToRegion.apply(w, group, tag) if _active(w, group) else w


class _ShareGrad(torch.autograd.Function):
    """identity forward, the gradient divided by the group's size backward."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.parts = group_size(name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.parts, None


def tp_grad_share(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """A whole value's full gradient made this rank's share, for a tp_sum further back to sum:
    the statistics of a norm over the sharded features also read whole (no communication)."""
    return _ShareGrad.apply(x, group) if _active(x, group) else x


def tp_sum(x: torch.Tensor, group: str, tag: str = "") -> torch.Tensor:
    """The sum of the ranks' partial sums over the sharded features, differentiable: Megatron's
    f then g, so the gradient is summed over the group too."""
    if not _active(x, group):
        return x
    return _ReduceFromRegion.apply(_CopyToRegion.apply(x, group, tag), group, tag)


class _SumBothWays(torch.autograd.Function):
    """all-reduce forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, name, tag):
        ctx.name, ctx.tag, ctx.summed = name, tag, None
        return all_reduce(x, name, tag)

    @staticmethod
    def backward(ctx, grad):
        # A split backward (ZB-H1) reaches this node twice, towards the stage's inputs and its
        # weights, with the same gradient: sum it once, as priced, and hand both the result.
        if ctx.summed is None:
            ctx.summed = all_reduce(grad, ctx.name, ctx.tag)
        return ctx.summed, None, None


def group_sum(x: torch.Tensor, group: str, tag: str = "", parts: int = 1) -> torch.Tensor:
    """The sum of x over the `parts` ranks of `group`, differentiable: the gradient is summed
    over the group too (see the module docstring). parts == 1: x itself."""
    return _SumBothWays.apply(x, group, tag) if _check_parts(x, group, parts) else x


class _Resequence(torch.autograd.Function):
    """One of four sequence moves forward, its adjoint backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, name, tag, dim, forward, backward):
        ctx.args = name, tag, dim, backward
        return _move(forward, x, name, tag, dim)

    @staticmethod
    def backward(ctx, grad):
        name, tag, dim, backward = ctx.args
        return _move(backward, grad, name, tag, dim), None, None, None, None, None


def _move(kind: str, x, name, tag, dim):
    if kind == "gather":
        return _gather(x, name, tag, dim)
    if kind == "reduce_scatter":
        return _reduce_scatter(x, name, tag, dim)
    return _take(x, name, dim)


def _resequence(x, group, tag, parts, dim, forward, backward):
    if _check_parts(x, group, parts):
        return _Resequence.apply(x, group, tag, dim, forward, backward)
    if forward == "gather":
        return torch.cat([x] * parts, dim)
    return x.narrow(dim, 0, x.shape[dim] // parts)


def sp_all_gather(x, group: str, tag: str = "", parts: int = 1, dim: int = 1):
    """Enter a TP region from sequence shards: gather forward, reduce-scatter the gradient."""
    return _resequence(x, group, tag, parts, dim, "gather", "reduce_scatter")


def sp_reduce_scatter(x, group: str, tag: str = "", parts: int = 1, dim: int = 1):
    """Leave a TP region onto sequence shards: sum the partials and keep this rank's slice."""
    return _resequence(x, group, tag, parts, dim, "reduce_scatter", "gather")


def sp_scatter(x, group: str, tag: str = "", parts: int = 1, dim: int = 1):
    """A replicated value onto sequence shards (no communication forward)."""
    return _resequence(x, group, tag, parts, dim, "take", "gather")


def sp_gather(x, group: str, tag: str = "", parts: int = 1, dim: int = 1):
    """Sequence shards to a replicated value (no communication backward)."""
    return _resequence(x, group, tag, parts, dim, "gather", "take")


def tp_gather(x, group: str, tag: str = "", parts: int = 1, dim: int = 1):
    """A column-parallel output whose every consumer needs it whole (a DiT's modulation, whose
    parts scale and shift replicated values): all-gather its feature blocks forward. Backward,
    its gradient is the same on every rank (it comes from replicated consumers), so each keeps
    its own block of it - no sum, which would multiply the gradient by the group's size."""
    return _resequence(x, group, tag, parts, dim, "gather", "take")


def whole_sequence(x: torch.Tensor, group: str, tag: str = "", parts: int = 1,
                   layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """A model input's whole sequence (dim 1) from the shards of the cp group (runtime.programs.token_split's
    layout), in global order: what a model builds from whole sequences, its attention mask, is
    built from it. No gradient (masks come from inputs and positions)."""
    if not _check_parts(x, group, parts):
        return torch.cat([x] * parts, dim)  # shapes only, or a group of one
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x  # gloo gathers no booleans
    pieces = _gather(wire.detach(), group, tag, dim).chunk(parts, dim)
    return unshard_sequence(pieces, dim, layout).to(x.dtype)


class _GatherLinear(torch.autograd.Function):
    """all-gather(x) followed by linears; saves the local x only and gathers it again backward."""

    @staticmethod
    def forward(ctx, x, name, tag, dim, count, *params):
        weights, biases = params[:count], params[count:]
        full = _gather(x, name, tag, dim)
        ctx.args = name, tag, dim, count, tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        name, tag, dim, count, has_bias = ctx.args
        x, *weights = ctx.saved_tensors
        with recomputing():
            full = _gather(x, name, tag, dim).flatten(0, -2)
        grad_full, grad_w, grad_b = None, [], []
        for g, w, bias in zip(grads, weights, has_bias):
            part = g.matmul(w)
            grad_full = part if grad_full is None else grad_full + part
            flat = g.flatten(0, -2)
            grad_w.append(flat.t().mm(full))
            grad_b.append(flat.sum(0) if bias else None)
        grad_x = _reduce_scatter(grad_full, name, tag, dim)
        return (grad_x, None, None, None, None, *grad_w, *grad_b)


def sp_gather_linear(x, weights: tuple, biases: tuple, group: str, tag: str = "", parts: int = 1,
                     dim: int = 1) -> tuple:
    """(F.linear(sp_all_gather(x), w, b) for each weight and bias), keeping only x for backward."""
    if _check_parts(x, group, parts):
        return _GatherLinear.apply(x, group, tag, dim, len(weights), *weights, *biases)
    full = torch.cat([x] * parts, dim) if parts > 1 else x
    return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))


tp_copy._fxpar_collective = "all_reduce_backward"
tp_all_reduce._fxpar_collective = "all_reduce"
tp_grad_sum._fxpar_collective = "all_reduce_backward"
tp_sum._fxpar_collective = "all_reduce"
tp_grad_share._fxpar_collective = "scale_backward"
sp_all_gather._fxpar_collective = "all_gather"
sp_reduce_scatter._fxpar_collective = "reduce_scatter"
sp_scatter._fxpar_collective = "all_gather_backward"
sp_gather._fxpar_collective = "all_gather"
tp_gather._fxpar_collective = "all_gather"
group_sum._fxpar_collective = "all_reduce"
whole_sequence._fxpar_collective = "all_gather"
