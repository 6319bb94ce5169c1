"""Roofline time of one kernel on one device.

    time = max(flops / (peak_flops * eff), nbytes / (mem_bw * bw_eff), kernel_floor)

A kernel is limited by whichever of arithmetic or memory traffic takes
longer, and never runs faster than the fixed launch/dispatch overhead.

A GEMM's `eff` is matmul_eff (what the largest GEMMs reach) times its shape's
efficiency on a GPU with `sms` streaming multiprocessors (NVIDIA, "Matrix
Multiplication Background User's Guide": tile and wave quantisation):

    tiles = groups * ceil(m / groups / 128) * ceil(n / 256)   (128 x 256 output tiles,
                                                               cuBLAS/CUTLASS's bf16 shape)
    waves = ceil(tiles / sms)
    shape = (m * n / (128 * 256)) / (waves * sms)  *  k / (k + 64)

The first factor is the share of the SMs' tile slots doing useful work: a GEMM
whose tiles fill 1.1 waves runs as long as one that fills 2. The second is the
main loop's fill and drain against its k / 64 steps of 64-deep tiles: a
shallow GEMM spends a larger share of its time outside the loop.
A grouped GEMM (groups > 1: a mixture-of-experts layer's experts) keeps
`cluster.grouped_gemm_eff` of that. Matmuls add `cluster.matmul_overhead` to their arithmetic term: a calibrated
CPU profile fits it because small GEMMs run well below the large-GEMM rate
(it is 0 in the presets, which keeps the plain roofline).
"""

from __future__ import annotations

import math

from cost_model.hardware.cluster import Cluster
from cost_model.ops.graph_facts import SDPA_BWD_FACTOR

__all__ = ["OP_CLASSES", "compute_time", "gemm_efficiency", "kernels_s", "op_seconds"]

OP_CLASSES = (
    "matmul",
    "attention",
    "norm",
    "elementwise",
    "embedding",
    "loss",
    "view",
    "comm",
)

# Views and reshapes launch no kernel; communication is priced by comm.py,
# so both cost nothing here (and no kernel floor either).
_FREE = ("view", "comm")


def _check_amount(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


TILE_M, TILE_N, TILE_K = 128, 256, 64


def gemm_efficiency(cluster: Cluster, m: float, n: float, k: float, groups: int = 1) -> float:
    """The shape's share of matmul_eff on the cluster's GPU (module doc); 1 where the cluster
    has no SM count (CPU)."""
    if not cluster.sms or m <= 0 or n <= 0 or k <= 0:
        return 1.0
    tiles = groups * math.ceil(m / groups / TILE_M) * math.ceil(n / TILE_N)
    waves = math.ceil(tiles / cluster.sms)
    useful = m * n / (TILE_M * TILE_N)
    return min(1.0, useful / (waves * cluster.sms)) * k / (k + TILE_K)


def compute_time(cluster: Cluster, flops: float, nbytes: float, op_class: str,
                 pairs: float = 0.0, floor: float = 0.0, gemm: tuple = ()) -> float:
    """Seconds for one kernel doing `flops` arithmetic over `nbytes` of memory
    traffic (reads + writes); fused attention also pays `cluster.attention_overhead` per
    (batch x head) pair (`pairs`, weighted by the pass: backward counts SDPA_BWD_FACTOR).
    `floor` raises the least time above cluster.kernel_floor (a training pass's op floor).
    `gemm`: a matmul's (m, n, k, groups) at this call's batch, for its shape's efficiency."""
    if op_class not in OP_CLASSES:
        raise ValueError(f"unknown op_class {op_class!r}; expected one of {list(OP_CLASSES)}")
    _check_amount("flops", flops)
    _check_amount("nbytes", nbytes)
    if op_class in _FREE:
        return 0.0
    # Non-matmul classes rarely run on tensor cores at matmul speed, but they
    # do so little arithmetic per byte that the memory term wins anyway;
    # pricing their flops at matmul speed keeps odd cases finite and sane.
    eff = cluster.attention_eff if op_class == "attention" else cluster.matmul_eff
    if op_class == "matmul" and gemm:
        eff *= gemm_efficiency(cluster, *gemm)
        if gemm[3] > 1:   # one GEMM per expert in a grouped kernel
            eff *= cluster.grouped_gemm_eff
    t_math = flops / (cluster.peak_flops * eff)
    if op_class == "elementwise" and cluster.pointwise_flops:
        t_math = flops / cluster.pointwise_flops
    if op_class == "attention" and flops > 0:
        t_math += pairs * cluster.attention_overhead
    if op_class == "matmul" and flops > 0:
        t_math += cluster.matmul_overhead
    t_mem = nbytes / (cluster.mem_bw * cluster.bw_eff)
    return max(t_math, t_mem, cluster.kernel_floor, floor)


def op_seconds(op, scale: float, cluster: Cluster, backward: bool) -> float:
    """One profiled op's forward or backward seconds at `scale` times its profiled batch
    (cost_model.layers.layer_cost.OpRecord): its roofline (compute_time), at least the pass's op floor,
    and at least its measured per-element time where the profile has one (Cluster.element_s).
    Where the cluster fuses pointwise chains, a pointwise op moves only its fused bytes
    (cost_model.layers.fusion), and one that moves none costs nothing."""
    if backward and not (op.bwd_flops or op.bwd_bytes):
        return compute_time(cluster, 0.0, 0.0, op.op_class)
    flops, nbytes, pairs, floor = (
        (op.bwd_flops, op.bwd_bytes, op.pairs * SDPA_BWD_FACTOR, cluster.backward_floor)
        if backward else (op.fwd_flops, op.fwd_bytes, op.pairs, cluster.forward_floor))
    fused = getattr(op, "fused_bytes", None)
    if cluster.fused_pointwise and fused is not None:  # a chain of pointwise ops, one kernel
        if not fused:
            return 0.0  # all its traffic stays inside the chain's kernel
        nbytes *= min(1.0, fused / op.fwd_bytes) if op.fwd_bytes else 1.0
    least = max(floor, cluster.element_s(op.per_element, backward) * op.elements * scale)
    gemm = (op.gemm[0] * scale, *op.gemm[1:]) if op.gemm else ()
    return compute_time(cluster, flops * scale, nbytes * scale, op.op_class, pairs * scale, least,
                        gemm)


def kernels_s(ops, scale: float, cluster: Cluster, backward: bool = False) -> float:
    """Seconds of profiled ops' plain rooflines (compute_time) in one pass at `scale` times
    their profiled batch, with no op floors: fused kernels as such."""
    return sum(compute_time(cluster, (op.bwd_flops if backward else op.fwd_flops) * scale,
                            (op.bwd_bytes if backward else op.fwd_bytes) * scale, op.op_class)
               for op in ops)
