"""What a runtime profile does to a layer's price (cost_model.hardware.runtimes): a pass takes at
least its kernels' host launches, and the runtime's overlap decides how much of the layer's
tensor-parallel communication stays exposed."""
from __future__ import annotations

from cost_model.hardware.cluster import Cluster

__all__ = ["launched", "tp_exposed"]


def launched(seconds: list[float], cluster: Cluster) -> float:
    """A pass's kernels: their time, or the host's time to launch them where that is longer
    (Cluster.host_op_s: a small layer's kernels finish before the next is launched). An op
    that costs nothing (a view, a pointwise op inside a fused chain) launches nothing."""
    return max(sum(seconds), sum(t > 0 for t in seconds) * cluster.host_op_s)


def tp_exposed(cluster: Cluster, tp: int, comm: tuple[float, float],
               gemm: list[float]) -> tuple[float, float]:
    """The forward and backward tensor-parallel communication left exposed by the runtime's
    overlap (Cluster.tp_overlap): "backward" hides the backward's behind the weight-gradient
    GEMMs (half the backward GEMMs' time), "pipelined" hides all but one of each collective's
    tp chunks behind its pass's GEMMs."""
    fwd, bwd = comm
    if cluster.tp_overlap == "backward":
        return fwd, bwd - min(bwd, gemm[1] / 2)
    if cluster.tp_overlap == "pipelined" and tp > 1:
        return tuple(c - min(c * (1 - 1 / tp), g) for c, g in zip(comm, gemm))
    return fwd, bwd
