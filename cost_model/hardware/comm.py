"""Alpha-beta (latency-bandwidth) times for ring collectives.

    time = steps * alpha + volume / (bw * comm_eff)

`volume` is what each rank sends over its link in a bandwidth-optimal ring
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH", 2005; the same counts nccl-tests uses to turn time
into "bus bandwidth"). With n ranks and a tensor of M bytes:

    all_reduce      2(n-1)/n * M   in 2(n-1) steps (reduce-scatter + all-gather)
    all_gather       (n-1)/n * M   in  n-1 steps   (M = gathered output)
    reduce_scatter   (n-1)/n * M   in  n-1 steps   (M = input)
    all_to_all       (n-1)/n * M   in  n-1 steps   (M = per-rank buffer)
    p2p                      M     in  1 step

Ranks are numbered tp innermost, then cp, dp, pp, and consecutive members of
a group sit `stride` ranks apart. A group whose span fits inside one node
uses the NVLink numbers; otherwise at least one ring hop crosses the
network and that slowest hop sets the pace of the whole ring.

Libraries do not all run the textbook ring, so each kind's two terms may
carry a measured multiplier, `Cluster.comm_correction(kind)`:

    time = steps * alpha * latency + volume / (bw * comm_eff * bandwidth)

Both default to 1 (the GPU presets keep the textbook model); `fxpar
calibrate` fits them from timings of each kind, with all_reduce as the
reference that defines alpha and bw. On CPU (gloo over loopback TCP) they
are far from 1 and for reasons that are known:
- reduce_scatter_tensor is an all-reduce of a copy followed by taking this
  rank's chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced): about
  twice the ring's latency and volume;
- all_to_all posts every pairwise exchange at once rather than n-1 ring
  steps;
- the "link" is the cores copying bytes through the kernel. Ring ranks send
  and receive at once, each side of a p2p transfer does one of the two, and a
  p2p message skips the collective's hand-off to gloo's worker thread, so
  p2p has both a far smaller latency and a larger bandwidth.
"""

from __future__ import annotations

from runtime.comm.wire import KINDS, check_count, check_kind, bytes_on_wire, ring_volume

from cost_model.hardware.cluster import Cluster

__all__ = [
    "KINDS",
    "collective_time",
    "collective_terms",
    "link",
    "ring_steps",
    "ring_volume",
    "bytes_on_wire",
    "crosses_nodes",
]

def ring_steps(kind: str, n: int) -> int:
    """Sequential message steps (each paying one alpha) for n ranks."""
    check_kind(kind)
    check_count("group size", n)
    if n == 1:
        return 0
    if kind == "p2p":
        return 1
    if kind == "all_reduce":
        return 2 * (n - 1)
    return n - 1


def crosses_nodes(cluster: Cluster, kind: str, group_size: int, stride: int = 1) -> bool:
    """Whether the group's ring (or the p2p pair) leaves a node."""
    check_kind(kind)
    check_count("group_size", group_size)
    check_count("stride", stride)
    if kind == "p2p":
        return stride >= cluster.gpus_per_node
    return (group_size - 1) * stride >= cluster.gpus_per_node


def collective_terms(
    cluster: Cluster, kind: str, nbytes: float, group_size: int, stride: int = 1
) -> tuple[int, float, bool]:
    """(ring steps, per-rank ring volume, crosses_nodes): the textbook terms,
    before the per-kind corrections. Calibration fits against these."""
    crosses = crosses_nodes(cluster, kind, group_size, stride)
    return ring_steps(kind, group_size), ring_volume(kind, nbytes, group_size), crosses


def link(cluster: Cluster, crosses: bool) -> tuple[float, float]:
    """(alpha, achieved bandwidth) of the link class a ring runs over."""
    if crosses:
        return cluster.inter_latency, cluster.inter_bw * cluster.comm_eff
    return cluster.intra_latency, cluster.intra_bw * cluster.comm_eff


def collective_time(
    cluster: Cluster, kind: str, nbytes: float, group_size: int, stride: int = 1
) -> float:
    """Seconds for one `kind` collective over `group_size` ranks; see module doc
    for what `nbytes` means per kind. Inside a training step a collective also pays
    `cluster.collective_handoff` (calibrated; 0 in the presets): its ranks come to it from
    computing, not from the previous collective."""
    steps, volume, crosses = collective_terms(cluster, kind, nbytes, group_size, stride)
    if steps == 0:
        return 0.0
    alpha, bw = link(cluster, crosses)
    latency, bandwidth = cluster.comm_correction(kind)
    return steps * alpha * latency + volume / (bw * bandwidth) + cluster.collective_handoff
