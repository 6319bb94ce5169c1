"""Measured set-up and training memory of a model no rank holds whole (examples/bench_setup_memory.py).

Every rank records its peak resident memory (ru_maxrss) three times: on entry, after importing
torch and joining the process group — an empty rank, the baseline —, after materialising its shard
(planner.weights.materialize), and after the training steps. The table sets each rank's peak less the
baseline beside the plan's predicted memory per device for that rank's stage.
"""
from __future__ import annotations

import dataclasses
import resource
import time

import torch

from planner.models.presets import ModelConfig
from planner.search.plan import Plan
from planner.training.pretrained import Source

GiB = 2**30


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_worker(config: ModelConfig, plan_json: str, steps: int, global_batch: int,
                  lr: float = 1e-4) -> dict:
    """One rank: the meta model, its shard materialised, `steps` steps of plain SGD (no optimizer
    state: the weights and gradients are what a rank holds)."""
    import torch.distributed as dist

    from planner.api import ParallelModel

    baseline = peak_rss()
    plan = Plan.from_json(plan_json)
    source = Source(config=config, global_batch=global_batch)
    batch = source.batch()
    pm = ParallelModel(source.meta_model(), plan, [], batch,
                       lambda params: torch.optim.SGD(params, lr=lr))
    start = time.perf_counter()
    trainer = pm.shard()
    setup_s, setup_peak = time.perf_counter() - start, peak_rss()
    unique = {id(p): p for prog in trainer.programs.values() for p in prog.gm.parameters()}
    shard_bytes = sum(p.numel() * p.element_size() for p in unique.values())
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(pm.train_step(*batch))
        times.append(time.perf_counter() - start)
    return dict(rank=dist.get_rank(), stage=trainer.groups.pp_index, baseline=baseline,
                setup_peak=setup_peak, peak=peak_rss(), shard_bytes=shard_bytes,
                setup_s=setup_s, step_s=times, losses=losses)


def predicted(plan: Plan, stage: int) -> tuple[float, float]:
    """(the plan's memory per device for a stage, as planned with Adam; the same without
    optimizer states: weights, gradients and activations — what plain SGD keeps)."""
    st = plan.stages[stage]
    return st.memory_bytes, st.param_bytes + st.activation_bytes


def vocab_parallel(plan: Plan) -> Plan:
    """The plan with the embedding and the head vocabulary-parallel, so no rank keeps a whole
    vocabulary matrix (the planner keeps them whole where communication is dear)."""
    stages = tuple(dataclasses.replace(st, strategies=tuple(
        "vocab-tp" if layer in ("embed", "head") else s
        for layer, s in zip(st.layers, st.strategies))) for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def table(plan: Plan, results: list[dict]) -> str:
    from tabulate import tabulate
    rows = []
    for r in results:
        adam, sgd = predicted(plan, r["stage"])
        used = r["peak"] - r["baseline"]
        rows.append([r["rank"], r["stage"], f"{r['baseline'] / GiB:.2f}",
                     f"{(r['setup_peak'] - r['baseline']) / GiB:.2f}", f"{r['peak'] / GiB:.2f}",
                     f"{used / GiB:.2f}", f"{sgd / GiB:.2f}", f"{used / sgd:.2f}",
                     f"{adam / GiB:.2f}"])
    return tabulate(rows, headers=["rank", "stage", "baseline GiB", "set-up peak - baseline",
                                   "peak RSS GiB", "peak - baseline", "predicted (SGD) GiB",
                                   "measured/predicted", "predicted (Adam) GiB"],
                    disable_numparse=True)
