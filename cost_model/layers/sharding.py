"""Sharded data parallel (ZeRO levels 0-3, hybrid sharding) priced: bytes each rank holds and the
data-parallel collectives of one step, as runtime.data_parallel.sharded_dp runs them.

With n = dp_shard x cp ranks sharing a shard group, r = dp / dp_shard replicate groups, and per
parameter w weight bytes, g gradient bytes and K optimizer bytes (cost_model.layers.memory):

    level   weights   gradients   optimizer   collectives per step (G gradient, W weight bytes)
    0       w         g           K           all-reduce(G) over n·r ranks
    1       w         g           K/n         reduce-scatter(G) once, all-gather(W) after the step
    2       w         g/n         K/n         reduce-scatter(G) per micro-batch, all-gather(W)
    3       w/n       g/n         K/n         reduce-scatter(G) per micro-batch, all-gather(W)
                                              before every use: each forward and each backward
                                              action (B; or I and W under ZB-H1) per micro-batch

Hybrid sharding adds an all-reduce of the gradient shard (G/n) over the r replicate ranks. Level
2 and 3 hold, besides the shards, one unit's whole gradient and its flat copy while it is
reduce-scattered; level 3 also up to two units' whole weights (the one in use and the prefetched
one): `transient_bytes`. Buffers are padded to a multiple of n elements (`padded`).

Overlap: every reduce-scatter and every all-gather of level 3 runs beside compute (the next
unit's parameters are prefetched a unit ahead, reduce-scatters are posted as backward produces
each unit's gradients), as does the bucketed all-reduce of level 0; the all-gather after the
optimizer step (levels 1-2) and the replicate all-reduce have nothing to hide behind.
`sync_parts` keeps the two apart. Where collectives run on a stream of their own beside compute
(GPUs: NCCL kernels on their own SMs; Cluster.comm_stream) the planner schedules the hideable
part (planner.search.ilp): it is exposed only where it outlasts the compute it runs beside —
every micro-batch's forward and backward at level 3, every backward at level 2, the last
micro-batch's backward at levels 0-1 — and never by less than one unit's share (the first
gather, or the last reduce, has no compute beside it). Elsewhere (CPU ranks, where gloo's thread
competes with compute for the cores) a measured share `cluster.dp_overlap` of it is hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.comm.wire import bytes_on_wire

LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True)
class Sharding:
    """level 0-3; n: ranks per shard group (dp_shard x cp); r: replicate groups (dp / dp_shard);
    m: micro-batches per step; backward_actions: 1 (B), or 2 under ZB-H1 (I and W)."""

    level: int = 0
    n: int = 1
    r: int = 1
    m: int = 1
    backward_actions: int = 1

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"zero level must be one of {LEVELS}, got {self.level!r}")
        for name in ("n", "r", "m", "backward_actions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def fractions(self) -> tuple[float, float, float]:
        """Shares of (weights, gradients, optimizer states) one rank holds."""
        n, level = self.n, self.level
        return (1 / n if level >= 3 else 1.0, 1 / n if level >= 2 else 1.0,
                1 / n if level >= 1 else 1.0)

    def gathers_per_step(self) -> int:
        """All-gathers of each unit's weights per step on this rank."""
        if self.level == 3:
            return self.m * (1 + self.backward_actions)
        return 1 if self.level in (1, 2) else 0

    def reduce_scatters_per_step(self) -> int:
        return 0 if self.level == 0 else 1 if self.level == 1 else self.m


def padded(numel: int, n: int) -> int:
    """Elements of a flat buffer of `numel` padded to a multiple of n."""
    return -(-numel // n) * n


def held_bytes(units: list[tuple[int, int, int]], sharding: Sharding,
               optimizer_states: int, state_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank holds between steps for buckets of (numel, weight bytes, grad bytes)
    each: weights, gradients and optimizer states (optimizer_states fp32 values per element)."""
    fw, fg, fo = sharding.fractions()
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for numel, wb, gb in units:
        full = padded(numel, sharding.n) if sharding.level else numel
        out["params"] += full * wb * fw
        out["grads"] += full * gb * fg
        out["optimizer"] += full * optimizer_states * state_bytes * fo
    return out


def step_traffic(units: list[tuple[int, int, int, int]], sharding: Sharding) -> dict[str, float]:
    """Bytes this rank sends per collective kind in one step, for buckets of (numel, weight
    bytes, grad bytes, backward gathers): the last is how many backward actions per micro-batch
    read the unit's weights (1 + ... ; 0 for an embedding, whose backward needs only the indices)
    under level 3. Ring formula of runtime.comm.wire."""
    s, out = sharding, {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    for numel, wb, gb, backward_gathers in units:
        if s.level == 0:
            out["all_reduce"] += bytes_on_wire("all_reduce", numel * gb, s.n * s.r)
            continue
        full = padded(numel, s.n)
        gathers = s.m * (1 + backward_gathers) if s.level == 3 else 1
        out["all_gather"] += gathers * bytes_on_wire("all_gather", full * wb, s.n)
        out["reduce_scatter"] += (s.reduce_scatters_per_step() *
                                  bytes_on_wire("reduce_scatter", full * gb, s.n))
        if s.r > 1:
            out["all_reduce"] += bytes_on_wire("all_reduce", full // s.n * gb, s.r)
    return out


def transient_bytes(unit_params: list[int], wb: int, gb: int, sharding: Sharding) -> float:
    """Whole-sized buffers alive at a time during a step beyond `held_bytes`: at levels 2-3 one
    unit's gradients and their flat copy, at level 3 two units' weights as well."""
    if sharding.level < 2 or not unit_params:
        return 0.0
    largest = sorted(unit_params, reverse=True)
    grads = 2 * largest[0] * gb
    weights = sum(largest[:2]) * wb if sharding.level == 3 else 0.0
    return grads + weights


def peak_buffers(unit_params: list[int], wb: int, gb: int, sharding: Sharding,
                 top_act: float = 0.0) -> tuple[float, float]:
    """What of `transient_bytes` can add to a rank's activation peak, as (in use, whole). The
    peak comes as the last backward starts, every activation set alive: then level 3 holds the
    whole weights of the unit in use and of the one before it, prefetched; a unit's whole gradients (levels 2-3) appear only as its
    backward ends, after it freed its share of that micro-batch's activations, so the whole
    transient adds to the peak less one activation set but for the rest of that set: the layers
    below, at most the set less its top layer (`top_act`, one micro-batch's activations of the
    largest layer; planner.search.ilp, "Memory"). Not so when the backward is split (ZB-H1's I
    and W): W makes a unit's whole gradients while all of that micro-batch's activations still
    live (they go with its graph once W returns), so the whole transient comes with every set."""
    if sharding.level < 2 or not unit_params:
        return 0.0, 0.0
    largest = sorted(unit_params, reverse=True)
    in_use = sum(largest[:2]) * wb if sharding.level == 3 else 0.0
    whole = transient_bytes(unit_params, wb, gb, sharding)
    if sharding.backward_actions == 2:
        return whole, whole
    return in_use, whole + top_act


@dataclass(frozen=True)
class SyncParts:
    """One step's data-parallel collectives for a rank, affine in its gradient bytes G:
    exposed = alpha + slope·G (nothing to hide behind), hideable = hide_alpha + hide_slope·G
    (runs beside compute), `beside` micro-batch passes of the rank's compute it runs beside
    (forward and backward of one micro-batch = 1)."""

    alpha: float
    slope: float
    hide_alpha: float = 0.0
    hide_slope: float = 0.0
    beside: float = 0.0

    def discounted(self, overlap: float) -> tuple[float, float]:
        """(latency, seconds per byte) with a share `overlap` of the hideable part hidden."""
        hidden = 1.0 - overlap
        return self.alpha + self.hide_alpha * hidden, self.slope + self.hide_slope * hidden


BACKWARD_SHARE = 2 / 3  # a backward does twice a forward's matmul FLOPs (Narayanan et al. 2021)


def sync_parts(sharding: Sharding, weight_per_grad: float, rs_alpha: float, rs_slope: float,
               ag_alpha: float, ag_slope: float, ar_alpha: float, ar_slope: float,
               units: int) -> SyncParts:
    """The SyncParts of a rank with `units` buckets; *_alpha / *_slope are one collective's
    latency and seconds per byte over the shard group (ar: the replicate group, or for level 0
    all replicas). weight_per_grad: weight bytes per gradient byte."""
    s = sharding
    if s.level == 0:
        return SyncParts(0.0, 0.0, ar_alpha, ar_slope, BACKWARD_SHARE)
    rs = s.reduce_scatters_per_step()
    hide_alpha, hide_slope = units * rs * rs_alpha, rs * rs_slope
    alpha = slope = 0.0
    gathers = s.gathers_per_step()
    gather_alpha = units * gathers * ag_alpha
    gather_slope = gathers * ag_slope * weight_per_grad
    if s.level == 3:
        hide_alpha, hide_slope = hide_alpha + gather_alpha, hide_slope + gather_slope
    else:
        alpha, slope = gather_alpha, gather_slope
    if s.r > 1:
        alpha += units * ar_alpha
        slope += ar_slope / s.n
    beside = float(s.m) if s.level == 3 else s.m * BACKWARD_SHARE if s.level == 2 \
        else BACKWARD_SHARE
    return SyncParts(alpha, slope, hide_alpha, hide_slope, beside)


def sync_terms(sharding: Sharding, weight_per_grad: float, rs_alpha: float, rs_slope: float,
               ag_alpha: float, ag_slope: float, ar_alpha: float, ar_slope: float,
               overlap: float, units: int) -> tuple[float, float]:
    """(exposed seconds of latency, exposed seconds per gradient byte) of one step's data-parallel
    collectives with a share `overlap` of the hideable ones hidden (sync_parts)."""
    return sync_parts(sharding, weight_per_grad, rs_alpha, rs_slope, ag_alpha, ag_slope,
                      ar_alpha, ar_slope, units).discounted(overlap)
