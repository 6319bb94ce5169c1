"""How fast a CPU host runs now against when its profile was calibrated.

A shared CPU host's speed drifts: one transformer block's forward and backward, timed by thread
CPU time every second for a minute, took 3.4-6.6 ms, and whole calibrations a few minutes apart
came out 20-30% apart in every compute rate. A profile is a snapshot of one such spell.
Calibration therefore also times a reference, in the same rounds as its compute probes
(cost_model.bench_compute.block_step: a transformer block's forward and backward, the mix of
matmuls, pointwise ops and autograd that CPU ranks run), and keeps its median in the profile
(Cluster.host_probe_s); `fxpar bench` times it again, the same way, just before each plan. Their
ratio is the host's drift: above 1 it runs slower now. The plan's prediction times the drift is
its prediction at the host's speed of the moment; the prediction itself is unchanged. Profiles
without the reference (GPU profiles, presets) give no drift (None).
"""
from __future__ import annotations

import torch

from cost_model.bench_compute import block_step, interleaved_medians
from cost_model.cluster import Cluster

ROUNDS = 15  # about 0.1 s on a two-core host


def reference_s(rounds: int = ROUNDS) -> float:
    """The reference's median seconds, one thread, timed as calibration times it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return interleaved_medians([block_step("cpu")], "cpu", rounds=rounds)[0]
    finally:
        torch.set_num_threads(threads)


def drift(cluster: Cluster | None) -> float | None:
    """The reference's time now over its time at calibration; None when the profile has none."""
    if cluster is None or not cluster.host_probe_s:
        return None
    return reference_s() / cluster.host_probe_s
