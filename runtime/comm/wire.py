"""Bytes a collective puts on each rank's link, by kind: what the runtime's traffic counters
record and what the cost model's bandwidth term moves (cost_model.hardware.comm times them).

With n ranks and a tensor of M bytes, in a bandwidth-optimal ring (Thakur, Rabenseifner & Gropp,
2005; the counts nccl-tests uses for "bus bandwidth"):

    all_reduce      2(n-1)/n * M
    all_gather       (n-1)/n * M   (M = gathered output)
    reduce_scatter   (n-1)/n * M   (M = input)
    all_to_all       (n-1)/n * M   (M = per-rank buffer)
    p2p                      M
"""
from __future__ import annotations

import math

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(KINDS)}")


def check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_bytes(nbytes: float) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)):
        raise ValueError(f"nbytes must be a number, got {nbytes!r}")
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be finite and >= 0, got {nbytes!r}")


def ring_volume(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank pushes through its link, the bandwidth term's volume."""
    check_kind(kind)
    check_bytes(nbytes)
    check_count("group size", n)
    if n == 1:
        return 0.0
    if kind == "p2p":
        return float(nbytes)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (n - 1) / n * nbytes


def bytes_on_wire(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends (p2p: the sender's). Equal to `ring_volume`
    because ring algorithms are bandwidth-optimal; kept as a separate name
    for traffic accounting, which should not change if the timing model
    later gains tree or hierarchical algorithms."""
    return ring_volume(kind, nbytes, n)
