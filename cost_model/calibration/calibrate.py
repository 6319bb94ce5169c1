"""Measure this machine and fit a cluster profile.

    python -m cost_model.calibration.calibrate --out profile.json     # or: fxpar calibrate

Compute, timed as training runs it and counted by the cost model's own
FLOP conventions (bench_compute.py): Linear forward + backward at several
shapes (peak_flops, matmul_eff, matmul_overhead), causal SDPA forward +
backward (attention_eff, attention_overhead per batch x head pair), large copies (mem_bw, bw_eff), a tiny op
(kernel_floor, and forward_floor / backward_floor: a tiny op recorded by autograd and its
backward node) and GELU, SiLU and exp forward + backward (pointwise_flops).

Communication: every collective the cost model prices, over several sizes
and group sizes, in real process groups (gloo on CPU, NCCL on CUDA), timed
by the harness the benchmarks use too (bench_comm.py:
`measure_collectives`). Then least-squares fits in log space (fitting.py):
alpha and bw per link class (intra- or inter-node, classed by the rule
comm.collective_time uses) from all_reduce, and per other kind the
latency/bandwidth multipliers that its own timings want (`fit_links`).

The runtime's own time, on CPU (planner/bench/runtime_probes.py, through `fxpar
calibrate`; `python -m cost_model.calibration.calibrate` leaves it out): the optimizer step per
tensor and per parameter, ZB-H1's split backward, the runtime's time per
pipeline action and per step on a one-rank training run, and how many cores
the ranks share. Plans on such a profile simulate the whole step
(planner.search.step_prediction).

This module runs those steps in order with a progress bar, picks the
preset that supplies what a run cannot measure, and writes the profile.
On CPU a "device" is one rank process running one torch thread, so the
compute numbers are measured single-threaded too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Sequence

import torch

from runtime.launch.progress import Progress

from cost_model.calibration.bench_comm import STOPPED_EARLY, collective_steps, measure_collectives
from cost_model.calibration.bench_compute import (COMPUTE_ROUNDS, POINTWISE_PROBES,
                            attention_flops, attention_step, interleaved_medians, linear_step,
                            measure_add, measure_autograd_floors, measure_copy,
                            measure_kernel_floor, per_element_steps, pointwise_step)
from cost_model.hardware.cluster import PER_ELEMENT_RULES, PRESETS, Cluster, save_profile
from cost_model.hardware.comm import KINDS
from cost_model.calibration.fitting import fit_alpha_beta, fit_links, fit_matmul
from cost_model.ops.graph_facts import BWD_FACTOR, SDPA_BWD_FACTOR

__all__ = ["calibrate", "format_bytes", "main"]

KiB, MiB = 2**10, 2**20
# Calibration sizes; the collective benchmark uses sizes in between so that
# it checks the fit out of sample.
COLLECTIVE_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
# Linear layers (tokens, out_features, in_features) timed forward + backward;
# matmul_eff is the median rate over them.
CPU_MATMULS = ((64, 64, 64), (256, 128, 128), (256, 256, 256), (512, 512, 512),
               (1024, 1024, 1024), (2048, 512, 512), (512, 2048, 512), (512, 512, 2048))
CUDA_MATMULS = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                (16384, 4096, 4096), (4096, 16384, 4096), (4096, 4096, 16384))
# Activations timed for pointwise_flops: large enough that the kernel floor is noise.
POINTWISE_ELEMENTS_CPU, POINTWISE_ELEMENTS_CUDA = 2**18, 2**26
# Causal attention shapes (batch, heads, seq, head_dim); attention_eff is the
# median rate over them.
CPU_ATTENTION = ((1, 8, 512, 64), (2, 8, 256, 64), (4, 8, 128, 64), (16, 8, 64, 16),
                 (32, 8, 32, 8))
CUDA_ATTENTION = ((4, 16, 2048, 128), (2, 32, 4096, 128), (8, 16, 1024, 128))


# --------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------
def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


class _Progress(Progress):
    """`[#####.....] 12/43 steps  7.2 s left  collectives n=2 round 3/15` on stderr; redraws in
    place on a terminal and prints one line per step otherwise (logs, CI): runtime.launch.progress."""

    def __init__(self, total: int, enabled: bool, width: int = 20):
        super().__init__(total, "step", enabled=enabled, width=width)

    def step(self, label: str, advance: int = 1) -> None:
        self.update(advance=advance, label=label)


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
    chains = [linear_chain(m, n, k) for m, n, k in linears]
    elements = POINTWISE_ELEMENTS_CUDA if cuda else POINTWISE_ELEMENTS_CPU
    per_element = [per_element_steps(rule, device) for rule in PER_ELEMENT_RULES]
    steps = ([linear_step(m, n, k, device, c) for (m, n, k), c in zip(linears, chains)]
             + [attention_step(b, h, s, d, device) for b, h, s, d in attentions]
             + [pointwise_step(name, elements, device) for name, _ in POINTWISE_PROBES])
    probes = [fn for fwd, step, _ in per_element for fn in (fwd, step)]
    seconds = interleaved_medians(steps + probes, device, on_round=lambda r: bar.step(
        f"linear, causal attention, norms, activations fwd+bwd: round {r + 1}/{COMPUTE_ROUNDS}"))
    element_fields = _per_element_fields(seconds[len(steps):], [n for _, _, n in per_element])
    seconds = seconds[:len(steps)]
    pointwise = [(1 + BWD_FACTOR) * per * elements / t for (_, per), t in
                 zip(POINTWISE_PROBES, seconds[len(steps) - len(POINTWISE_PROBES):])]
    seconds = seconds[:len(steps) - len(POINTWISE_PROBES)]
    seconds = [t / c for t, c in zip(seconds, chains)] + seconds[len(linears):]  # per Linear
    flops = ([(1 + BWD_FACTOR) * 2 * m * n * k for m, n, k in linears]
             + [attention_flops(*shape) for shape in attentions])
    rates = [f / t for f, t in zip(flops, seconds)]
    rates = rates[:len(linears)]
    matmul_rate, overhead = fit_matmul(flops[:len(linears)], seconds[:len(linears)])
    # per (batch x head) pair, forward + backward weighted as compute_time weighs them
    attention_overhead, attention_rate = fit_alpha_beta(
        [(b * h * (1 + SDPA_BWD_FACTOR), f, t) for (b, h, _, _), f, t in
         zip(attentions, flops[len(linears):], seconds[len(linears):])])
    big = 1 * 2**30 if cuda else 64 * MiB  # well past the last-level cache
    bw_rates = [2 * big / measure_copy(big, device), 2 * 2 * big / measure_copy(2 * big, device),
                3 * big / measure_add(big, device)]
    bar.step(f"memory bandwidth {format_bytes(big)}")
    floor = measure_kernel_floor(device)
    forward_floor, backward_floor = measure_autograd_floors(device)
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
        attention_eff=min(1.0, attention_rate / peak / _sdpa_share(device)),
        attention_overhead=attention_overhead,
        mem_bw=mem_bw,
        bw_eff=min(1.0, statistics.median(bw_rates) / mem_bw),
        kernel_floor=floor,
        pointwise_flops=statistics.median(pointwise),
        forward_floor=forward_floor,
        backward_floor=backward_floor,
        **element_fields,
    )


def _sdpa_share(device: str) -> float:
    """The measured attention is torch SDPA's flash kernel (FlashAttention-2); a GPU profile
    holds its generation's fastest fused kernel's rate, which a runtime profile scales to the
    kernel it runs (cost_model.hardware.runtimes.apply): the measured rate over FA2's share.
    1 on CPU, whose profile is fxpar's runtime as measured."""
    from cost_model.hardware.runtimes import ATTENTION_SHARE
    base = _base_cluster(device)
    return ATTENTION_SHARE[base.gpu_arch]["fa2"] if device.startswith("cuda") else 1.0


def _per_element_fields(seconds: list[float], elements: list[int]) -> dict:
    """{rule_fwd, rule_bwd} seconds per element from each PER_ELEMENT_RULES rule's
    (forward, forward + backward) times."""
    fields = {}
    for rule, fwd, both, n in zip(PER_ELEMENT_RULES, seconds[::2], seconds[1::2], elements):
        fields[f"{rule}_fwd"] = fwd / n
        fields[f"{rule}_bwd"] = max(0.0, both - fwd) / n
    return fields


def linear_chain(m: int, n: int, k: int) -> int:
    """Linear layers per timed step: small ones in a chain of 8, so that one backward call's
    start-up is shared as a block shares it; large ones alone (their overhead is noise)."""
    return 8 if m * n * k <= 2**24 else 1


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
    runtime=None,
) -> Cluster:
    """Measure this machine and return (and, with `out`, save) its profile. `runtime` measures
    the runtime's own terms on CPU (planner.bench.runtime_probes.RuntimeProbe, which `fxpar calibrate`
    passes; it trains a probe, which needs the planner above this package)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but CUDA is not available")
    base = _base_cluster(device)
    sizes = _usable_world_sizes(device, world_sizes)
    n_compute = COMPUTE_ROUNDS + 2
    n_runtime = runtime.steps if runtime is not None and device == "cpu" else 0
    bar = _Progress(n_compute + len(sizes) * collective_steps() + n_runtime, progress)
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
    if n_runtime:  # the runtime's own terms, measured with the compute numbers just fitted
        fields.update(runtime(dataclasses.replace(base, **fields), sizes, bar.step))
    if device == "cpu":
        # The runtime starts a stage's data-parallel all-reduce once its last backward is done;
        # with one stage per rank that is the end of the rank's schedule (and gloo's reductions
        # want the same cores): nothing hides it.
        fields["dp_overlap"] = 0.0
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


def main(argv: Sequence[str] | None = None, runtime=None) -> int:
    parser = argparse.ArgumentParser(prog="fxpar calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", help="write the profile JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    t0, load = time.perf_counter(), _load()
    cluster = calibrate(args.device, args.world_sizes, args.out, progress=not args.quiet,
                        runtime=runtime)
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
