"""Ring attention's price inside a layer under context parallelism (cost_model.layers.layer_cost.price;
`profile` below is its LayerProfile).

  compute   on clusters whose runtime is measured (CPU profiles), the ring's block loops op by op
            (`ring_compute_s`: cost_model.ops.ring_attention traces them once per shape; each op a
            forward kernel, at its traced groups times the micro-batch's, plus the runtime's time
            per call). Presets keep the fused kernel's price (`fused_attention_s`), which no
            device run has checked against the ring yet.
  messages  forward passes this rank's key/value block cp − 1 times; backward passes it again and
            carries fp32 dK/dV accumulators cp hops home. Each transfer overlaps the attention
            computed on the block in hand, so only what the transfers exceed it is exposed
            (`ring_exposed`).
"""
from __future__ import annotations

from typing import NamedTuple

from cost_model.hardware.cluster import Cluster
from cost_model.hardware.comm import collective_time
from cost_model.hardware.compute import kernels_s, op_seconds
from cost_model.ops.ring_attention import TRACED_GROUPS, is_call, ring_op_counts


class Ring(NamedTuple):
    fwd_s: float       # exposed seconds
    bwd_s: float
    sent: float        # bytes, forward and backward
    fwd_sent: float    # of which forward (what recomputation sends again)


def ring_compute_s(profile, micro_batch: int, cp: int,
                   cluster: Cluster) -> tuple[float, float]:
    """Forward and backward seconds of the layer's ring attentions' own compute."""
    def seconds(counted, scale: float) -> float:
        return sum(n * (op_seconds(op, scale, cluster, backward=False)
                        + (cluster.op_overhead if is_call(op) else 0.0))
                   for op, n in counted)
    fwd = bwd = 0.0
    for shape in profile.rings:
        f_ops, b_ops = ring_op_counts(shape, cp)
        scale = micro_batch * shape.kv_heads / TRACED_GROUPS
        fwd += seconds(f_ops, scale)
        bwd += seconds(b_ops, scale)
    return fwd, bwd


def fused_attention_s(profile, scale: float,
                      cluster: Cluster) -> tuple[float, float]:
    """Forward and backward seconds of the layer's fused attention kernels."""
    attention = [op for op in profile.ops if op.op_class == "attention"]
    return (kernels_s(attention, scale, cluster),
            kernels_s(attention, scale, cluster, backward=True))


def ring_exposed(profile, scale: float, cluster: Cluster, tp: int, cp: int,
                 fwd: float, bwd: float) -> Ring:
    """Exposed forward and backward seconds and bytes sent of ring attention per micro-batch,
    `fwd` and `bwd` being the ring's compute that hides its transfers. On a cluster that prices
    the runtime's own time, a hop takes at least the measured hand-off, and each message (keys
    and values apart, dK and dV apart) costs its sender the post, which no computation hides."""
    kv, acc = profile.kv_bytes * scale, profile.kv_grad_bytes * scale
    sent = (cp - 1) * kv + (cp - 1) * kv + cp * acc

    def hop(nbytes: float) -> float:
        return max(collective_time(cluster, "p2p", nbytes, 2, stride=tp), cluster.p2p_handoff)
    posts = 2 * cluster.send_overhead
    return Ring(max(0.0, (cp - 1) * hop(kv) - fwd) + (cp - 1) * posts,
                max(0.0, (cp - 1) * hop(kv) + cp * hop(acc) - bwd) + (2 * cp - 1) * posts,
                sent, (cp - 1) * kv)
