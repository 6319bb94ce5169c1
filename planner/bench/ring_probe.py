"""Ring attention's own time beyond its price, measured for `fxpar calibrate` (CPU ranks).

  ring_step_fwd,   two gloo ranks train RING_MODEL under context parallelism (cp=2, one stage,
  ring_step_bwd    1F1B), each step's parts timed by runtime.observe.step_timing. What an F or a B takes
                   beyond its price (the plan's fwd_s and bwd_s plus the action floor, priced with
                   every term calibrated before it: the ring's traced ops and messages, the
                   runtime's time per op and per action) is spread over the ring steps the action
                   runs (cp per attention and pass): the Python between blocks, gloo's batched
                   post and wake-up, and waiting for the peer's block, which no op count sees.
                   Medians over the steps.
"""
from __future__ import annotations

import dataclasses
import json
import statistics

import torch

from cost_model.hardware.cluster import Cluster

# A model of its own, not one a benchmark runs (the runtime probe's sizes): its 16 tokens split
# into 2·cp zig-zag chunks.
RING_MODEL = dict(arch="gpt", layers=2, hidden=32, heads=4, vocab=128, seq=16, global_batch=8,
                  name="ring-probe")
CP = 2
MICROBATCHES = 2
STEPS, WARMUP = 8, 2


def ring_plan(cluster: Cluster):
    """RING_MODEL and its cp=2 plan, priced by `cluster` without ring terms (what is measured)."""
    from planner.api import plan
    from planner.models.presets import ModelConfig
    config = ModelConfig(**RING_MODEL)
    unpriced = dataclasses.replace(cluster, ring_step_fwd=0.0, ring_step_bwd=0.0)
    fix = dict(cp=CP, dp=1, tp=1, pp=1, schedule="1f1b",
               mb=config.global_batch // MICROBATCHES)
    return config, plan(config, CP, cluster=unpriced, fix=fix)[0]


def _ring_worker(cluster_json: str) -> dict | None:
    """On each rank: the median F0 and B0 per micro-batch over the steps; rank 0 returns both
    ranks' (the slower is what a step waits for) with the plan's prices."""
    import torch.distributed as dist

    from planner.api import ParallelModel
    from planner.models.presets import build_model, example_batch
    from planner.training.local import make_optimizer
    from runtime.observe.step_timing import StepClock

    torch.set_num_threads(1)
    cluster = Cluster.from_json(json.loads(cluster_json))
    config, chosen = ring_plan(cluster)
    batch = example_batch(config, config.global_batch)
    pm = ParallelModel(build_model(config, device="meta"), chosen, [], batch, make_optimizer)
    parts = []
    for step in range(WARMUP + STEPS):
        dist.barrier()
        with StepClock(pm.shard()) as clock:
            pm.train_step(*batch)
        if step >= WARMUP:
            parts.append(clock.parts())
    mine = {k: statistics.median(p[k] for p in parts) / MICROBATCHES for k in ("F0", "B0")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank = dist.get_rank()
    pm.close()  # before the worker returns, where gloo's threads could abort the process
    if rank:
        return None
    stage = chosen.stages[0]
    return ring_terms(max(r["F0"] for r in everyone), max(r["B0"] for r in everyone),
                      stage.fwd_s + cluster.action_floor, stage.bwd_s + cluster.action_floor,
                      rings=config.layers, cp=CP)


def ring_terms(fwd: float, bwd: float, priced_fwd: float, priced_bwd: float, rings: int,
               cp: int) -> dict:
    """ring_step_fwd and ring_step_bwd from measured and priced seconds of an F and a B whose
    stage runs `rings` ring attentions of `cp` steps each pass; never negative (noise)."""
    steps = rings * cp
    return dict(ring_step_fwd=max(0.0, (fwd - priced_fwd) / steps),
                ring_step_bwd=max(0.0, (bwd - priced_bwd) / steps))


def measure_ring(cluster: Cluster) -> dict:
    """ring_step_fwd, ring_step_bwd on two gloo ranks, `cluster` holding every other term."""
    from runtime.launch.ranks import run_local
    return run_local(_ring_worker, CP, (json.dumps(cluster.to_json()),))[0]
