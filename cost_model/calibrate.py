"""Measure this machine and fit a cluster profile.

    python -m cost_model.calibrate --out profile.json     # or: fxpar calibrate

Compute: matmuls of several shapes (peak_flops, matmul_eff), SDPA
(attention_eff), large copies (mem_bw, bw_eff) and a tiny op (kernel_floor).
Communication: every collective the cost model prices, over several sizes
and group sizes, in real process groups (gloo on CPU, NCCL on CUDA); then a
least-squares fit (in log space) of  time = steps * alpha + volume / bw
across all kinds at once, one alpha and bandwidth per link class (intra- or
inter-node, classed by the same rule comm.collective_time uses).

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

__all__ = [
    "calibrate",
    "fit_alpha_beta",
    "fit_links",
    "measure_collective",
    "measure_collectives",
    "measure_matmul",
    "main",
]

KiB, MiB = 2**10, 2**20
# Calibration sizes; the collective benchmark uses sizes in between so that
# it checks the fit out of sample.
COLLECTIVE_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
CPU_MATMULS = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
               (2048, 512, 512), (512, 2048, 512), (512, 512, 2048))
CUDA_MATMULS = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                (16384, 4096, 4096), (4096, 16384, 4096), (4096, 4096, 16384))


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


def _median_time(fn: Callable[[], object], device: str, reps: int = 5, inner: int = 1) -> float:
    """Median over `reps` of the mean time of `inner` back-to-back calls.

    On CPU a calibrated device is one single-threaded rank: its compute is timed by this thread's
    CPU time, which other processes sharing the cores do not inflate (the wall clock would fit
    the machine's load at calibration time into the profile)."""
    clock = time.thread_time if device == "cpu" else time.perf_counter
    fn()  # warm-up: first calls pay for allocation and kernel selection
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((clock() - t0) / inner)
    return statistics.median(times)


def _dtype(device: str) -> torch.dtype:
    # Match what the presets' peak_flops describe: bf16 on GPU, fp32 on CPU.
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def measure_matmul(m: int, n: int, k: int, device: str = "cpu", reps: int = 5) -> float:
    """Median seconds of one (m x k) @ (k x n) matmul; it does 2*m*n*k FLOPs."""
    a = torch.randn(m, k, device=device, dtype=_dtype(device))
    b = torch.randn(k, n, device=device, dtype=_dtype(device))
    out = torch.empty(m, n, device=device, dtype=_dtype(device))
    return _median_time(lambda: torch.mm(a, b, out=out), device, reps)


def measure_attention(b: int, h: int, s: int, d: int, device: str = "cpu") -> float:
    """Median seconds of one non-causal SDPA forward; 4*b*h*s*s*d FLOPs."""
    q = torch.randn(b, h, s, d, device=device, dtype=_dtype(device))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return _median_time(lambda: sdpa(q, q, q), device)


def measure_copy(nbytes: int, device: str = "cpu") -> float:
    """Median seconds to copy `nbytes` (2 * nbytes of memory traffic)."""
    x = torch.zeros(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return _median_time(lambda: y.copy_(x), device)


def measure_add(nbytes: int, device: str = "cpu") -> float:
    """Median seconds of out = x + y on `nbytes` tensors (3 * nbytes traffic)."""
    x = torch.zeros(nbytes // 4, device=device)
    y, z = torch.zeros_like(x), torch.empty_like(x)
    return _median_time(lambda: torch.add(x, y, out=z), device)


def measure_kernel_floor(device: str = "cpu") -> float:
    """Seconds per tiny op in a back-to-back stream: the dispatch/launch cost
    every eager kernel pays however little it does."""
    x = torch.ones(1, device=device)
    return _median_time(lambda: x.add_(0), device, reps=5, inner=200)


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


def _make_op(kind: str, nbytes: int, rank: int, n: int, dev: str) -> Callable[[], None]:
    """A closure running one `kind` collective with the cost model's meaning
    of nbytes (see comm.py); float32 elements, length divisible by n."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.zeros(numel, device=dev)
    shard = torch.zeros(numel // n, device=dev)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(full, shard)
    if kind == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(shard, full)
    if kind == "all_to_all":
        out = torch.empty_like(full)
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


def _time_op(op: Callable[[], None], dev: str, reps: int) -> float:
    """Seconds per op. Each repetition starts at a barrier and ends when this
    rank's last op returns (gloo ops block until the rank's part is done);
    the slowest rank's time counts. No trailing barrier: its own cost is as
    large as a small collective and too noisy to subtract on a busy host."""
    inner = _inner_count(op, dev)
    times = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            op()
        _sync(dev)
        times[i] = (time.perf_counter() - t0) / inner
    times = times.to(dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return max(statistics.median(times.tolist()), 1e-7)


REP_SECONDS = 0.02  # each timed repetition lasts at least this long


def _inner_count(op: Callable[[], None], dev: str) -> int:
    """Ops per timed repetition, agreed by all ranks. Short repetitions are
    at the mercy of the scheduler's time slice (milliseconds) on a busy
    host; ~20 ms of ops averages that out. (Measured on a loaded 2-core
    host: run-to-run spread of the median was ~20% with 20 ms repetitions,
    ~33% taking the minimum of 3 ms ones.)"""
    op()  # warm-up: first use of a buffer size allocates and connects
    t0 = time.perf_counter()
    op()
    _sync(dev)
    slowest = torch.tensor([time.perf_counter() - t0], device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(1, min(64, math.ceil(REP_SECONDS / max(slowest.item(), 1e-7))))


def _collective_worker(rank, n, port, plan, device, reps, results) -> None:
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
        timeout=timedelta(seconds=60),
    )
    try:
        times = []
        for i, (kind, nbytes) in enumerate(plan):
            op = _make_op(kind, nbytes, rank, n, dev)
            t = _time_op(op, dev, reps)
            times.append(t / 2 if kind == "p2p" else t)
            if rank == 0:
                results.put(("progress", i))
        if rank == 0:
            results.put(("done", times))
    finally:
        dist.destroy_process_group()


def measure_collectives(
    plan: Sequence[tuple[str, int]],
    world_size: int,
    device: str = "cpu",
    reps: int = 5,
    on_progress: Callable[[int], None] | None = None,
) -> list[float]:
    """Median seconds of each (kind, nbytes) in `plan`, measured in one
    process group of `world_size` ranks (one spawn for the whole plan,
    because starting the workers costs seconds)."""
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to measure collectives, got {world_size}")
    for kind, _ in plan:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(KINDS)}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (world_size, _free_port(), list(plan), device, reps, results)
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
    """Median seconds of one collective (see comm.py for what nbytes means)."""
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
    """`[#####.....] 12/40 all_reduce 4 MiB n=4` on stderr; redraws in place
    on a terminal and prints one line per step otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool, width: int = 20):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.tty = enabled and sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
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
    rates = []
    for m, n, k in CUDA_MATMULS if cuda else CPU_MATMULS:
        rates.append(2 * m * n * k / measure_matmul(m, n, k, device))
        bar.step(f"matmul {m}x{k}x{n}")
    b, h, s, d = (4, 16, 2048, 128) if cuda else (1, 8, 512, 64)
    attn_rate = 4 * b * h * s * s * d / measure_attention(b, h, s, d, device)
    bar.step(f"attention s={s}")
    big = 1 * 2**30 if cuda else 64 * MiB  # well past the last-level cache
    bw_rates = [2 * big / measure_copy(big, device), 2 * 2 * big / measure_copy(2 * big, device),
                3 * big / measure_add(big, device)]
    bar.step(f"memory bandwidth {format_bytes(big)}")
    floor = measure_kernel_floor(device)
    bar.step("kernel floor")
    # Datasheet peaks are the honest denominators when the GPU is known; on
    # CPU (and unknown GPUs) the best rate seen is the practical peak, since
    # turbo and vector clocks vary from chip to chip.
    vendor = _vendor_preset(device)
    peak = vendor.peak_flops if vendor else max(rates)
    mem_bw = vendor.mem_bw if vendor else max(bw_rates)
    return dict(
        peak_flops=peak,
        matmul_eff=min(1.0, statistics.median(rates) / peak),
        attention_eff=min(1.0, attn_rate / peak),
        mem_bw=mem_bw,
        bw_eff=min(1.0, statistics.median(bw_rates) / mem_bw),
        kernel_floor=floor,
    )


def _collective_plan(sizes: Sequence[int]) -> list[tuple[str, int]]:
    return [(kind, size) for kind in KINDS for size in sizes]


def _calibrate_comm(device: str, world_sizes: Sequence[int], bar: _Progress) -> list[tuple]:
    """(kind, group size, nbytes, seconds) over all kinds, sizes and world sizes."""
    measurements = []
    plan = _collective_plan(COLLECTIVE_SIZES)
    for n in world_sizes:
        def progress(i: int, n: int = n) -> None:
            kind, size = plan[i]
            bar.step(f"{kind} {format_bytes(size)} n={n}")

        times = measure_collectives(plan, n, device, on_progress=progress)
        measurements += [(kind, n, size, t) for (kind, size), t in zip(plan, times)]
    return measurements


def fit_links(cluster: Cluster, measurements: Sequence[tuple]) -> dict:
    """Fit alpha/bw per link class from (kind, group size, nbytes, seconds)
    taken with stride 1. Each measurement is classed intra- or inter-node by
    the same rule `collective_time` uses with `cluster.gpus_per_node`; a class
    without data borrows the other's fit. Returns Cluster fields, with
    comm_eff = 1 because a fitted bandwidth is already an achieved one."""
    classes: dict[bool, list] = {False: [], True: []}
    for kind, n, nbytes, seconds in measurements:
        steps, volume, crosses = collective_terms(cluster, kind, nbytes, n)
        classes[crosses].append((steps, volume, seconds))
    fits = {c: fit_alpha_beta(rows) for c, rows in classes.items() if len(rows) >= 2}
    if not fits:
        raise ValueError("need at least two collective timings to fit the links")
    intra = fits.get(False, fits.get(True))
    inter = fits.get(True, intra)
    return dict(intra_latency=intra[0], intra_bw=intra[1],
                inter_latency=inter[0], inter_bw=inter[1], comm_eff=1.0)


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
                inter_bw=base.inter_bw * base.comm_eff, comm_eff=1.0)


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
    n_compute = len(CUDA_MATMULS if device == "cuda" else CPU_MATMULS) + 3
    bar = _Progress(n_compute + len(sizes) * len(KINDS) * len(COLLECTIVE_SIZES), progress)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxpar calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", help="write the profile JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    cluster = calibrate(args.device, args.world_sizes, args.out, progress=not args.quiet)
    for key, value in cluster.to_json().items():
        print(f"{key:>14}: {value:.4g}" if isinstance(value, float) else f"{key:>14}: {value}")
    wrote = f"; wrote {args.out}" if args.out else ""
    print(f"calibrated in {time.perf_counter() - t0:.1f} s{wrote}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
