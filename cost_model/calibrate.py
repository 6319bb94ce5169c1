"""Measure this machine and fit a cluster profile.

    python -m cost_model.calibrate --out profile.json     # or: fxpar calibrate

Compute, timed as training runs it and counted by the cost model's own
FLOP conventions: Linear forward + backward at several shapes (peak_flops,
matmul_eff), causal SDPA forward + backward (attention_eff), large copies
(mem_bw, bw_eff) and a tiny op (kernel_floor).

Communication: every collective the cost model prices, over several sizes
and group sizes, in real process groups (gloo on CPU, NCCL on CUDA), timed
by the harness the benchmarks use too (`measure_collectives`). Then
least-squares fits in log space: alpha and bw per link class (intra- or
inter-node, classed by the rule comm.collective_time uses) from all_reduce,
and per other kind the latency/bandwidth multipliers that its own timings
want (`fit_links`).

On CPU a "device" is one rank process running one torch thread, so the
compute numbers are measured single-threaded too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import queue as queue_mod
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cluster import PRESETS, Cluster, save_profile
from .comm import KINDS, collective_terms
from .op_graph import BWD_FACTOR, SDPA_BWD_FACTOR

__all__ = [
    "calibrate",
    "fit_alpha_beta",
    "fit_links",
    "measure_attention",
    "measure_collective",
    "measure_collectives",
    "measure_linear",
    "measure_matmul",
    "median_time",
    "interleaved_medians",
    "main",
]

KiB, MiB = 2**10, 2**20
# Calibration sizes; the collective benchmark uses sizes in between so that
# it checks the fit out of sample.
COLLECTIVE_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
# Linear layers (tokens, out_features, in_features) timed forward + backward;
# matmul_eff is the median rate over them.
CPU_MATMULS = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
               (2048, 512, 512), (512, 2048, 512), (512, 512, 2048))
CUDA_MATMULS = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                (16384, 4096, 4096), (4096, 16384, 4096), (4096, 4096, 16384))
# Causal attention shapes (batch, heads, seq, head_dim); attention_eff is the
# median rate over them.
CPU_ATTENTION = ((1, 8, 512, 64), (2, 8, 256, 64), (4, 8, 128, 64))
CUDA_ATTENTION = ((4, 16, 2048, 128), (2, 32, 4096, 128), (8, 16, 1024, 128))


# --------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------
def fit_alpha_beta(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Fit  seconds = steps * alpha + volume / bw  to (steps, volume, seconds)
    samples; returns (alpha, bw).

    The fit minimises squared *log* errors: timings span orders of
    magnitude and noise is multiplicative, so a plain least-squares fit
    would let the largest messages decide everything and mispredict small
    ones many times over. A linear fit of relative residuals gives the
    starting point; Levenberg-Marquardt in log-parameters (which keeps
    alpha and bw positive) refines it.
    """
    rows = [(s, v, t) for s, v, t in samples if t > 0 and s + v > 0]
    if len(rows) < 2:
        raise ValueError("need at least two timings with positive duration to fit alpha and bw")
    alpha, inv_bw = _fit_relative_linear(rows)
    x, y = _refine_log(rows, math.log(max(alpha, _TINY_ALPHA)), math.log(inv_bw))
    return math.exp(x), 1.0 / math.exp(y)


_TINY_ALPHA = 1e-12  # seconds; "no measurable latency"


def _fit_relative_linear(rows) -> tuple[float, float]:
    """Least squares of (steps*alpha + volume*inv_bw) / t - 1, clamped >= 0."""
    ab = [(s / t, v / t) for s, v, t in rows]
    saa = sum(a * a for a, _ in ab)
    sbb = sum(b * b for _, b in ab)
    sab = sum(a * b for a, b in ab)
    sa, sb = sum(a for a, _ in ab), sum(b for _, b in ab)
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        alpha, inv_bw = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
        if alpha >= 0 and inv_bw > 0:
            return alpha, inv_bw
    # Degenerate or a negative latency: fall back to a bandwidth-only start;
    # the log-space refinement brings alpha back if the data wants it.
    if sbb > 0 and sb > 0:
        return 0.0, sb / sbb
    raise ValueError("timings do not grow with message size; cannot fit a bandwidth")


def _log_cost(rows, x: float, y: float) -> float:
    ea, eb = math.exp(x), math.exp(y)
    return sum(math.log((s * ea + v * eb) / t) ** 2 for s, v, t in rows)


def _refine_log(rows, x: float, y: float, iters: int = 200) -> tuple[float, float]:
    """Levenberg-Marquardt on r_i = log(pred_i / t_i), parameters x = log alpha,
    y = log(1/bw)."""
    lam, cost = 1e-3, _log_cost(rows, x, y)
    for _ in range(iters):
        ea, eb = math.exp(x), math.exp(y)
        g0 = g1 = h00 = h01 = h11 = 0.0
        for s, v, t in rows:
            p = s * ea + v * eb
            r, j0, j1 = math.log(p / t), s * ea / p, v * eb / p
            g0, g1 = g0 + j0 * r, g1 + j1 * r
            h00, h01, h11 = h00 + j0 * j0, h01 + j0 * j1, h11 + j1 * j1
        a00, a11 = h00 * (1 + lam) + 1e-12, h11 * (1 + lam) + 1e-12
        det = a00 * a11 - h01 * h01
        dx, dy = (-g0 * a11 + g1 * h01) / det, (-g1 * a00 + g0 * h01) / det
        nx, ny = max(x + dx, math.log(_TINY_ALPHA)), y + dy
        new = _log_cost(rows, nx, ny)
        if new <= cost:
            converged = cost - new <= 1e-12 * max(cost, 1e-300)
            x, y, cost, lam = nx, ny, new, lam / 3
            if converged:
                break
        else:
            lam *= 4
    return x, y


# --------------------------------------------------------------------------
# Compute microbenchmarks
# --------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], device: str, reps: int = 5, inner: int = 1,
                clock: str | None = None) -> float:
    """Median over `reps` of the mean time of `inner` back-to-back calls,
    after one warm-up call. Shared with examples/bench_costs.py, so that
    calibration and the benchmark time compute the same way.

    On CPU a calibrated device is one single-threaded rank: its compute is timed by this thread's
    CPU time (clock "thread"), which other processes sharing the cores do not inflate (the wall
    clock would fit the machine's load at calibration time into the profile). GPUs use the wall
    clock around a synchronize."""
    now = CLOCKS[clock or ("thread" if device == "cpu" else "wall")]
    fn()  # warm-up: first calls pay for allocation and kernel selection
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = now()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((now() - t0) / inner)
    return statistics.median(times)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
COMPUTE_ROUNDS = 9  # timed rounds of the compute microbenchmarks


def interleaved_medians(fns: Sequence[Callable[[], object]], device: str,
                        rounds: int = COMPUTE_ROUNDS, clock: str | None = None,
                        on_round: Callable[[int], None] | None = None) -> list[float]:
    """Median seconds of each of `fns`, over `rounds` rounds that call every
    one of them once in turn (after one warm-up call each), timed as
    `median_time` times them. Shared with examples/bench_costs.py.

    Why rounds: a shared host's speed drifts, even by CPU time (a single-
    threaded Linear measured 64-80 GFLOP/s from one minute to the next here),
    so timing each function in one burst lets a fast or slow spell set that
    function's number alone. Interleaved, every function sees the same mix of
    spells over the whole run."""
    now = CLOCKS[clock or ("thread" if device == "cpu" else "wall")]
    for fn in fns:
        fn()  # warm-up: first calls pay for allocation and kernel selection
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for fn, mine in zip(fns, times):
            t0 = now()
            fn()
            _sync(device)
            mine.append(now() - t0)
        if on_round is not None:
            on_round(r)
    return [statistics.median(mine) for mine in times]


def _dtype(device: str) -> torch.dtype:
    # Match what the presets' peak_flops describe: bf16 on GPU, fp32 on CPU.
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def measure_matmul(m: int, n: int, k: int, device: str = "cpu", reps: int = 5) -> float:
    """Median seconds of one (m x k) @ (k x n) matmul; it does 2*m*n*k FLOPs."""
    a = torch.randn(m, k, device=device, dtype=_dtype(device))
    b = torch.randn(k, n, device=device, dtype=_dtype(device))
    out = torch.empty(m, n, device=device, dtype=_dtype(device))
    return median_time(lambda: torch.mm(a, b, out=out), device, reps)


def measure_linear(m: int, n: int, k: int, device: str = "cpu", reps: int = 5) -> float:
    """Median seconds of `linear_step(m, n, k, device)`."""
    return median_time(linear_step(m, n, k, device), device, reps)


def linear_step(m: int, n: int, k: int, device: str = "cpu") -> Callable[[], None]:
    """Forward + backward of a Linear(k -> n) with bias on m tokens:
    (1 + BWD_FACTOR) * 2*m*n*k FLOPs as the cost model counts them.

    This, not a bare matmul, is what `matmul_eff` prices in training: the
    forward runs x @ W^T (+ bias), the backward grad @ W and grad^T @ x (two
    transposed layouts BLAS runs at its own speeds) plus the bias gradient
    and autograd's bookkeeping. Pricing blocks from bare contiguous matmuls
    made every block predicted too fast."""
    dtype = _dtype(device)
    layer = torch.nn.Linear(k, n, device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=dtype)

    def step() -> None:
        layer.zero_grad(set_to_none=True)  # fresh grads, as the first micro-batch writes them
        x.grad = None
        layer(x).backward(grad)

    return step


def measure_attention(b: int, h: int, s: int, d: int, device: str = "cpu") -> float:
    """Median seconds of `attention_step(b, h, s, d, device)`."""
    return median_time(attention_step(b, h, s, d, device), device)


def attention_step(b: int, h: int, s: int, d: int, device: str = "cpu") -> Callable[[], None]:
    """Causal SDPA forward + backward, the attention that decoder training
    runs; the cost model counts 4*b*h*s*s*d / 2 FLOPs forward (causal halves
    them) and SDPA_BWD_FACTOR times that backward.

    A non-causal forward alone (what this used to time) runs at over twice
    the rate per counted FLOP on CPU, which priced attention far too cheap."""
    dtype = _dtype(device)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step() -> None:
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(grad)

    return step


def attention_flops(b: int, h: int, s: int, d: int) -> float:
    """Forward + backward FLOPs of causal SDPA by the cost model's count."""
    return (1 + SDPA_BWD_FACTOR) * 4 * b * h * s * s * d / 2


def measure_copy(nbytes: int, device: str = "cpu") -> float:
    """Median seconds to copy `nbytes` (2 * nbytes of memory traffic)."""
    x = torch.zeros(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return median_time(lambda: y.copy_(x), device)


def measure_add(nbytes: int, device: str = "cpu") -> float:
    """Median seconds of out = x + y on `nbytes` tensors (3 * nbytes traffic)."""
    x = torch.zeros(nbytes // 4, device=device)
    y, z = torch.zeros_like(x), torch.empty_like(x)
    return median_time(lambda: torch.add(x, y, out=z), device)


def measure_kernel_floor(device: str = "cpu") -> float:
    """Seconds per tiny op in a back-to-back stream: the dispatch/launch cost
    every eager kernel pays however little it does."""
    x = torch.ones(1, device=device)
    return median_time(lambda: x.add_(0), device, reps=5, inner=200)


# --------------------------------------------------------------------------
# Collective microbenchmarks (one process group per world size)
# --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has
# only the old ones. Same (output, input) signatures.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _make_op(kind: str, nbytes: int, rank: int, n: int, dev: str,
             buffers: dict | None = None) -> Callable[[], None]:
    """A closure running one `kind` collective with the cost model's meaning
    of nbytes (see comm.py); float32 elements, length divisible by n. Ops of
    the same size share `buffers` (their contents do not matter), so that a
    whole plan can stay allocated while its rounds are interleaved."""
    numel = max(n, nbytes // 4 // n * n)
    buffers = {} if buffers is None else buffers
    if numel not in buffers:
        buffers[numel] = (torch.zeros(numel, device=dev), torch.zeros(numel // n, device=dev),
                          torch.zeros(numel, device=dev))
    full, shard, out = buffers[numel]
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(full, shard)
    if kind == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(shard, full)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(out, full)
    return _make_pingpong(full, rank)


def _make_pingpong(buf: torch.Tensor, rank: int) -> Callable[[], None]:
    # Two one-way messages (0 -> 1 -> 0); the caller halves the time. A
    # ping-pong needs no clock agreement between the two ranks.
    def op() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return op


# Timed rounds per collective. Each round times every collective of the plan
# once (`inner` ops back to back), and a collective's time is its fastest op
# (see `_time_plan`).
ROUNDS = 15
REP_SECONDS = 0.004  # each timed repetition lasts at least this long
MAX_INNER = 64  # ops per repetition at most
# On a host so loaded that ROUNDS rounds would take longer than this, stop
# after the round that passes it (but not before MIN_ROUNDS): calibration
# has to finish in minutes, and the fastest of a few rounds is already a
# fair estimate.
ROUNDS_BUDGET_S = 40.0
MIN_ROUNDS = 4
STOPPED_EARLY = "stopped early: the host is busy"  # the progress label that says so


def _time_rep(op: Callable[[], None], inner: int, dev: str) -> list[float]:
    """Seconds of each of `inner` back-to-back ops on this rank, starting at
    a barrier: each op from the previous one's return (or the barrier) to its
    own, since gloo ops block until this rank's part is done. In a stream of
    ops each rank starts the next as soon as the last one ends, so that is
    the op's time as the slowest rank sees it."""
    dist.barrier()
    times, last = [], time.perf_counter()
    for _ in range(inner):
        op()
        _sync(dev)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def _inner_count(op: Callable[[], None], dev: str) -> int:
    """Ops per timed repetition, agreed by all ranks: enough to give many
    samples of a small op per round without making a round of large ones
    long. Also the warm-up: the first use of a buffer size allocates and
    connects."""
    op()
    fastest = min(_time_rep(op, 2, dev))
    slowest = torch.tensor([fastest], device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(1, min(MAX_INNER, math.ceil(REP_SECONDS / max(slowest.item(), 1e-7))))


def _time_plan(ops: Sequence[Callable[[], None]], dev: str, rounds: int,
               progress: Callable[[str], None]) -> list[float]:
    """Seconds of each of `ops`: the fastest single op over `rounds`
    interleaved repetitions, each op counted at its slowest rank.

    Why the fastest: other processes on a shared host can only add time to a
    collective, and on a loaded 2-core host they add a lot: a process that
    sleeps in a receive waits for the scheduler to run it again, so a
    ping-pong that takes 0.2 ms took 6-8 ms through whole repetitions. The
    fastest op is the one nothing delayed, an estimate of the machine's own
    cost that barely moves with load (as compute is timed by CPU time for
    the same reason), so calibration and the benchmark, run at different
    times, see the same machine. Interleaving the rounds spreads each burst
    of load over the whole plan instead of spoiling every sample of a few
    collectives."""
    inner = [_inner_count(op, dev) for op in ops]
    progress("warm-up")
    times = torch.full((rounds, len(ops), MAX_INNER), math.inf, dtype=torch.float64)
    start = time.perf_counter()
    for r in range(rounds):
        for i, op in enumerate(ops):
            times[r, i, :inner[i]] = torch.tensor(_time_rep(op, inner[i], dev))
        progress(f"round {r + 1}/{rounds}")
        if MIN_ROUNDS <= r + 1 < rounds and _agree_out_of_time(start, dev):
            progress(STOPPED_EARLY)
            break
    times = times.to(dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # unused slots stay inf on every rank
    return times.amin(dim=(0, 2)).clamp(min=1e-7).tolist()


def _agree_out_of_time(start: float, dev: str) -> bool:
    """Whether any rank has spent ROUNDS_BUDGET_S on rounds; all ranks get
    the same answer, so they stop after the same round."""
    late = torch.tensor([float(time.perf_counter() - start > ROUNDS_BUDGET_S)], device=dev)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def _collective_worker(rank, n, port, plan, device, rounds, results) -> None:
    torch.set_num_threads(1)  # one core per rank, as in CPU training
    cuda = device.startswith("cuda")
    dev = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=120),
    )
    try:
        buffers: dict = {}
        ops = [_make_op(kind, nbytes, rank, n, dev, buffers) for kind, nbytes in plan]
        report = (lambda label: results.put(("progress", label))) if rank == 0 else (lambda _: None)
        times = _time_plan(ops, dev, rounds, report)
        if rank == 0:
            results.put(("done", [t / 2 if kind == "p2p" else t
                                  for (kind, _), t in zip(plan, times)]))
    finally:
        dist.destroy_process_group()


def collective_steps(rounds: int = ROUNDS) -> int:
    """Progress steps `measure_collectives` reports per world size."""
    return 1 + rounds


def measure_collectives(
    plan: Sequence[tuple[str, int]],
    world_size: int,
    device: str = "cpu",
    rounds: int = ROUNDS,
    on_progress: Callable[[str], None] | None = None,
) -> list[float]:
    """Seconds of each (kind, nbytes) in `plan`, measured in one process
    group of `world_size` ranks (one spawn for the whole plan, because
    starting the workers costs seconds). Calibration and the benchmarks both
    measure through here, so they time collectives the same way."""
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to measure collectives, got {world_size}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for kind, _ in plan:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(KINDS)}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (world_size, _free_port(), list(plan), device, rounds, results)
    procs = mp.spawn(_collective_worker, args=args, nprocs=world_size, join=False)
    times = None
    # Drain the queue while waiting: a child with unread queue data cannot exit.
    while True:
        done = procs.join(timeout=0.1)
        try:
            while True:
                tag, value = results.get_nowait()
                if tag == "done":
                    times = value
                elif on_progress is not None:
                    on_progress(value)
        except queue_mod.Empty:
            pass
        if done:
            break
    if times is None:
        raise RuntimeError(f"collective workers (n={world_size}) exited without reporting results")
    return times


def measure_collective(kind: str, nbytes: int, world_size: int, device: str = "cpu") -> float:
    """Seconds of one collective (see comm.py for what nbytes means)."""
    return measure_collectives([(kind, nbytes)], world_size, device)[0]


# --------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------
def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


class _Progress:
    """`[#####.....] 12/43 collectives n=2 round 3/15` on stderr; redraws in place
    on a terminal and prints one line per step otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool, width: int = 20):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.tty = enabled and sys.stderr.isatty()

    def step(self, label: str, advance: int = 1) -> None:
        self.done = min(self.total, self.done + advance)
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {label}"
        sys.stderr.write(f"\r{line:<72}" if self.tty else line + "\n")
        if self.tty and self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# --------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------
_GPU_PRESETS = (("H200", "h200-sxm-dgx"), ("H100", "h100-sxm-dgx"), ("A100", "a100-80g-dgx"))


def _vendor_preset(device: str) -> Cluster | None:
    """The GPU preset describing the local GPU, if there is one."""
    if not device.startswith("cuda"):
        return None
    gpu = torch.cuda.get_device_name(0).upper()
    return next((PRESETS[name] for key, name in _GPU_PRESETS if key in gpu), None)


def _base_cluster(device: str) -> Cluster:
    """Starting point, so that fields this run cannot measure (inter-node
    links, dp_overlap) keep sensible values."""
    if not device.startswith("cuda"):
        return PRESETS["cpu-gloo"]
    return _vendor_preset(device) or PRESETS["a100-80g-dgx"]


def _calibrate_compute(device: str, bar: _Progress) -> dict:
    cuda = device.startswith("cuda")
    linears = CUDA_MATMULS if cuda else CPU_MATMULS
    attentions = CUDA_ATTENTION if cuda else CPU_ATTENTION
    steps = ([linear_step(m, n, k, device) for m, n, k in linears]
             + [attention_step(b, h, s, d, device) for b, h, s, d in attentions])
    seconds = interleaved_medians(steps, device, on_round=lambda r: bar.step(
        f"linear fwd+bwd, causal attention fwd+bwd: round {r + 1}/{COMPUTE_ROUNDS}"))
    flops = ([(1 + BWD_FACTOR) * 2 * m * n * k for m, n, k in linears]
             + [attention_flops(*shape) for shape in attentions])
    rates = [f / t for f, t in zip(flops, seconds)]
    rates, attn_rates = rates[:len(linears)], rates[len(linears):]
    matmul_rate, overhead = _fit_matmul(flops[:len(linears)], seconds[:len(linears)])
    big = 1 * 2**30 if cuda else 64 * MiB  # well past the last-level cache
    bw_rates = [2 * big / measure_copy(big, device), 2 * 2 * big / measure_copy(2 * big, device),
                3 * big / measure_add(big, device)]
    bar.step(f"memory bandwidth {format_bytes(big)}")
    floor = measure_kernel_floor(device)
    bar.step("kernel floor")
    # Datasheet peaks are the honest denominators when the GPU is known; on
    # CPU (and unknown GPUs) the best rate seen is the practical peak, since
    # turbo and vector clocks vary from chip to chip. Only peak * eff enters
    # a prediction, so the choice of denominator does not change any time.
    vendor = _vendor_preset(device)
    peak = vendor.peak_flops if vendor else max(*rates, matmul_rate)
    mem_bw = vendor.mem_bw if vendor else max(bw_rates)
    return dict(
        peak_flops=peak,
        matmul_eff=min(1.0, matmul_rate / peak),
        matmul_overhead=overhead,
        attention_eff=min(1.0, statistics.median(attn_rates) / peak),
        mem_bw=mem_bw,
        bw_eff=min(1.0, statistics.median(bw_rates) / mem_bw),
        kernel_floor=floor,
    )


# A Linear's forward + backward is priced as two matmul calls (forward and
# backward), each paying matmul_overhead once.
PRICED_CALLS_PER_LINEAR = 2


def _fit_matmul(flops: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(rate, overhead) with  seconds = 2 * overhead + flops / rate  for the
    Linear fwd+bwd timings: the same two-term fit as a link's alpha and bw
    (fit_alpha_beta, in log space), here separating small GEMMs' lower rate
    from the large-GEMM rate. A single median rate priced small layers too
    fast and large ones too slow."""
    rows = [(PRICED_CALLS_PER_LINEAR, f, t) for f, t in zip(flops, seconds)]
    overhead, rate = fit_alpha_beta(rows)
    return rate, overhead


def _collective_plan(sizes: Sequence[int]) -> list[tuple[str, int]]:
    return [(kind, size) for kind in KINDS for size in sizes]


def _calibrate_comm(device: str, world_sizes: Sequence[int], bar: _Progress) -> list[tuple]:
    """(kind, group size, nbytes, seconds) over all kinds, sizes and world sizes."""
    measurements = []
    plan = _collective_plan(COLLECTIVE_SIZES)
    for n in world_sizes:
        end = bar.done + collective_steps()

        def progress(label: str, n: int = n, end: int = end) -> None:
            # Rounds cut short by a busy host take the bar to this group's end.
            bar.step(f"collectives n={n} {label}", end - bar.done if label == STOPPED_EARLY else 1)

        times = measure_collectives(plan, n, device, on_progress=progress)
        measurements += [(kind, n, size, t) for (kind, size), t in zip(plan, times)]
    return measurements


REFERENCE_KIND = "all_reduce"  # defines alpha and bw; other kinds are corrected relative to it


FIT_PASSES = 8  # alternations of the link and correction fits (converged well before)


def fit_links(cluster: Cluster, measurements: Sequence[tuple]) -> dict:
    """Fit the links and the per-kind corrections from (kind, group size,
    nbytes, seconds) taken with stride 1. Returns Cluster fields, with
    comm_eff = 1 because a fitted bandwidth is already an achieved one.

    One alpha and bw cannot fit kinds that the library implements
    differently (see comm.py), so the model is
        seconds = steps * alpha[class] * latency[kind]
                  + volume / (bw[class] * bandwidth[kind])
    with the reference kind's multipliers fixed at 1 (that is what alpha and
    bw mean). Each measurement is classed intra- or inter-node by the rule
    `collective_time` uses with `cluster.gpus_per_node`; a class without
    data borrows the other's fit. The two halves are fitted in turn, each in
    log space by `fit_alpha_beta`: the links first from the reference kind
    alone, then corrections given the links, then the links from every
    kind's corrected terms, and so on. Letting every kind inform the links
    matters because a kind's multipliers are shared by both classes: links
    set by the reference kind's few timings alone would push any noise in
    them into every other kind's predictions."""
    rows = [(kind, *collective_terms(cluster, kind, nbytes, n), seconds)
            for kind, n, nbytes, seconds in measurements]
    links = _fit_link_classes(rows, {REFERENCE_KIND: (1.0, 1.0)})
    for _ in range(FIT_PASSES):
        corrections = _fit_corrections(rows, links)
        links = _fit_link_classes(rows, corrections)
    corrections = _fit_corrections(rows, links)
    (intra_latency, intra_bw), (inter_latency, inter_bw) = links[False], links[True]
    return dict(intra_latency=intra_latency, intra_bw=intra_bw, inter_latency=inter_latency,
                inter_bw=inter_bw, comm_eff=1.0, comm_corrections=corrections)


def _fit_corrections(rows: Sequence[tuple], links: dict) -> dict[str, tuple[float, float]]:
    """Per kind, the (latency, bandwidth) multipliers of the link terms that
    best fit its timings over all classes; the reference kind's are 1."""
    corrections = {REFERENCE_KIND: (1.0, 1.0)}
    for kind in KINDS:
        mine = [(steps * links[crosses][0], volume / links[crosses][1], seconds)
                for k, steps, volume, crosses, seconds in rows if k == kind]
        if kind != REFERENCE_KIND and len(mine) >= 2:
            corrections[kind] = fit_alpha_beta(mine)
    return corrections


def _fit_link_classes(rows: Sequence[tuple], corrections: dict) -> dict[bool, tuple]:
    """{crosses: (alpha, bw)} from (kind, steps, volume, crosses, seconds)
    rows of the kinds in `corrections`, their terms scaled by them; a class
    with too few such rows uses all of its rows uncorrected."""
    fits = {}
    for crosses in (False, True):
        mine = [r for r in rows if r[3] == crosses]
        scaled = [(s * corrections[k][0], v / corrections[k][1], t)
                  for k, s, v, _, t in mine if k in corrections]
        use = scaled if len(scaled) >= 2 else [(s, v, t) for _, s, v, _, t in mine]
        if len(use) >= 2:
            fits[crosses] = fit_alpha_beta(use)
    if not fits:
        raise ValueError("need at least two collective timings to fit the links")
    intra = fits.get(False, fits.get(True))
    return {False: intra, True: fits.get(True, intra)}


def _cpu_ranks_per_node(world_sizes: Sequence[int]) -> int:
    """A CPU "node" holds as many single-threaded ranks as the host has
    cores. Past that, ranks time-share cores and every ring step also waits
    for the scheduler, which behaves like a slower, higher-latency link, so
    larger groups are priced with the "inter-node" numbers. On a host with
    enough cores this is simply the largest world size (intra == inter)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, max(world_sizes)))


def _usable_world_sizes(device: str, world_sizes: Sequence[int]) -> list[int]:
    sizes = sorted({int(n) for n in world_sizes if n >= 2})
    if device.startswith("cuda"):
        have = torch.cuda.device_count()
        skipped = [n for n in sizes if n > have]
        if skipped:
            print(f"calibrate: skipping world sizes {skipped}: only {have} GPU(s)", file=sys.stderr)
        sizes = [n for n in sizes if n <= have]
    return sizes


def _with_ranks_per_node(base: Cluster, device: str, sizes: Sequence[int]) -> Cluster:
    """GPU presets keep their node size; on CPU it depends on the cores."""
    if device == "cpu":
        return dataclasses.replace(base, gpus_per_node=_cpu_ranks_per_node(sizes))
    return base


def _comm_fields(base: Cluster, measurements: Sequence[tuple]) -> dict:
    link = fit_links(base, measurements)
    if base.device == "cpu":
        return link
    # One node of GPUs: only the NVLink class was measured. The preset's
    # nominal inter-node figure is rescaled by its comm_eff so that both
    # classes are achieved rates under the fitted comm_eff = 1.
    return dict(intra_latency=link["intra_latency"], intra_bw=link["intra_bw"],
                inter_bw=base.inter_bw * base.comm_eff, comm_eff=1.0,
                comm_corrections=link["comm_corrections"])


def calibrate(
    device: str = "cpu",
    world_sizes: Sequence[int] = (2, 4),
    out: str | os.PathLike | None = None,
    progress: bool = True,
) -> Cluster:
    """Measure this machine and return (and, with `out`, save) its profile."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but CUDA is not available")
    base = _base_cluster(device)
    sizes = _usable_world_sizes(device, world_sizes)
    n_compute = COMPUTE_ROUNDS + 2
    bar = _Progress(n_compute + len(sizes) * collective_steps(), progress)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # a CPU "device" is one single-threaded rank
    try:
        fields = _calibrate_compute(device, bar)
    finally:
        torch.set_num_threads(threads)
    if sizes:
        base = _with_ranks_per_node(base, device, sizes)
        fields.update(_comm_fields(base, _calibrate_comm(device, sizes, bar)))
    cluster = dataclasses.replace(base, name=f"{base.name}-calibrated", **fields)
    if out is not None:
        save_profile(cluster, out)
    return cluster


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _warn_if_busy(load: float) -> None:
    """Timings resist load (CPU time for compute, fastest op for collectives)
    but not fully: on a host with several times more runnable processes than
    cores, large transfers cannot finish between two preemptions."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if load > 4 * (cores or 1):  # the load counts our own ranks too
        print(f"calibrate: warning: load average {load:.1f} on {cores} core(s); other processes "
              "slowed these measurements, so re-run on a quieter host for a faithful profile",
              file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxpar calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", help="write the profile JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    t0, load = time.perf_counter(), _load()
    cluster = calibrate(args.device, args.world_sizes, args.out, progress=not args.quiet)
    _warn_if_busy(max(load, _load()))
    for key, value in cluster.to_json().items():
        if key == "comm_corrections":
            for kind, c in value.items():
                print(f"{kind:>14}: latency x{c['latency']:.3g}, bandwidth x{c['bandwidth']:.3g}")
        else:
            print(f"{key:>14}: {value:.4g}" if isinstance(value, float) else f"{key:>14}: {value}")
    wrote = f"; wrote {args.out}" if args.out else ""
    print(f"calibrated in {time.perf_counter() - t0:.1f} s{wrote}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
