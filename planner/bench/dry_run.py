"""A dry run: one rank's real programs for two training steps on fake tensors, on one CPU.

The rank joins a fake process group (torch.distributed's "fake" backend: collectives return at
once, nothing is sent) of the plan's world size as the rank it is asked to be, builds its shard
under a FakeTensorMode (tensors with shapes and no data: a 70B model's shard costs nothing), and
trains under a runtime.observe.memory_tracker MemoryTracker counting that mode's tensors. What
the programs allocate and free is what a real rank's would; only values are missing, so a
step's scalars (a loss read with .item(), a count of targets) read as 1 and a branch on a value
takes that side, and a collective that exchanges Python objects (all_gather_object: which
stages hold a tied weight, for one) answers every rank's share with this rank's own. Mixture-
of-experts layers route evenly (no values to route by), or as a measured run of the same plan
recorded them (runtime.experts.routing_log: to set the two side by side), and a step runs the
fewest micro-batches that reach the plan's peaks (`fewer_microbatches`) unless it replays a
recording, which holds every micro-batch's routing. The kernels
are the CPU's; for a plan on GPUs, the ops CUDA runs fused where the CPU composes them keep
what the fused kernel keeps (planner.bench.gpu_kernels: RMSNorm on 16-bit inputs).
"""
from __future__ import annotations

import multiprocessing
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AnyScalar(TorchDispatchMode):
    """Reading a fake tensor's value (aten._local_scalar_dense: .item(), bool(), float()) gives
    1 of its dtype instead of raising: a dry run has shapes and no values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def dry_run_rank(spec, plan, rank: int, options: dict | None = None, steps: int = 2,
                 routing=()):
    """Rank `rank` of `plan` for `steps` training steps on fake tensors (module docstring):
    its planner.bench.memory.RankMemory. `spec` builds the model (a preset config or an HFSpec,
    as planner.training.local.build takes), or is (model, example inputs): a module (on the
    meta device, or real) and inputs of the global batch's shapes (meta tensors will do).
    `routing`: the rank's recorded mixture-of-experts routing to replay (none: even)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.api import ParallelModel
    from planner.bench.memory import RankMemory, tracked_steps
    from runtime.comm.collectives import fake_run
    from runtime.experts.routing_log import replaying
    from runtime.observe.memory_tracker import MemoryTracker
    from runtime.training.trainer import TrainOptions

    if dist.is_initialized():
        raise RuntimeError("a dry run joins a fake process group of its own; run it outside "
                           "a distributed launch (torchrun), where no group is set up")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.gpus)
    gather = dist.all_gather_object
    dist.all_gather_object = _own_object
    try:
        meta, batch_fn = _model_and_batch(spec)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        tracker = MemoryTracker(fake_mode=fake)
        with fake, AnyScalar(), fake_run(_backend(plan)), _device_kernels(plan, fake):
            batch = batch_fn()
            with tracker:
                pm = ParallelModel(meta, plan, [], batch,
                                   lambda params: torch.optim.AdamW(params, lr=1e-4),
                                   options=TrainOptions(**(options or {})))
                with replaying(routing):
                    tracked_steps(tracker, pm, batch, steps)
        return RankMemory(rank, tracker.peak_bytes, tracker.split())
    finally:
        dist.all_gather_object = gather
        dist.destroy_process_group()


def _backend(plan) -> str:
    """The backend the plan's ranks run on: NCCL on GPUs, gloo on CPU ranks."""
    from cost_model.hardware.cluster import get_cluster
    return "nccl" if get_cluster(plan.cluster).device == "cuda" else "gloo"


def _device_kernels(plan, fake_mode):
    """For a plan on GPUs, what CUDA's fused kernels keep where the CPU's composed ones keep
    more on `fake_mode`'s tensors (planner.bench.gpu_kernels); nothing changes for CPU
    ranks."""
    import contextlib

    from cost_model.hardware.cluster import get_cluster
    from planner.bench.gpu_kernels import fused_norms
    return fused_norms(fake_mode) if get_cluster(plan.cluster).device == "cuda" else \
        contextlib.nullcontext()


def _own_object(out: list, obj, group=None) -> None:
    """all_gather_object in a dry run: the fake group sends nothing, so every share is ours."""
    out[:] = [obj] * len(out)


def _model_and_batch(spec):
    """(the model, a function making its batch): inputs of the given shapes are zeros (token
    0 everywhere: values do not matter to a dry run)."""
    from planner.bench.memory import meta_model
    if not isinstance(spec, tuple):
        return meta_model(spec, lazy_batch=True)
    model, inputs = spec
    return model, lambda: tuple(torch.zeros(x.shape, dtype=x.dtype) for x in inputs)


def dry_run(spec, plan, options: dict | None = None, ranks=None, steps: int = 2,
            routing=None, workers: int = 1) -> list:
    """Every rank of `plan` (or those in `ranks`) dry-run: one RankMemory each, in rank order.
    The step runs the fewest micro-batches that reach the same peaks (`fewer_microbatches`),
    or all of them where `routing` (each rank's recorded routing, by rank) is replayed.
    `workers` > 1 dry-runs that many ranks at once (`_in_processes`); 0: one per CPU core."""
    ranks = list(range(plan.gpus) if ranks is None else ranks)
    if routing and any(routing):
        jobs = [(spec, plan, r, options, steps, routing[r]) for r in ranks]
    else:
        short = fewer_microbatches(plan)
        spec = _with_batch(spec, short.global_batch)
        jobs = [(spec, short, r, options, steps) for r in ranks]
    workers = min(len(jobs), workers or _cores())
    if workers > 1 and sys.platform == "linux":
        return _in_processes(jobs, workers)
    return [dry_run_rank(*job) for job in jobs]


def _in_processes(jobs: list, workers: int) -> list:
    """The jobs' dry runs in `workers` forked processes: each rank joins a fake process group of
    its own, and one process can hold one group at a time. Forked, not spawned, so that the
    model (a user's module, on the meta device) is inherited rather than pickled; fork is
    used on Linux only, where it is safe with torch (its intra-op threads are reset in the
    child): elsewhere the ranks run one after another."""
    sys.stdout.flush()
    sys.stderr.flush()
    global _JOBS
    _JOBS = jobs
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS = []


_JOBS: list = []   # the jobs a forked worker inherits (_in_processes)


def _cores() -> int:
    """The CPU cores this process may run on (a container's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


def _job(index: int):
    return dry_run_rank(*_JOBS[index])


def fewer_microbatches(plan):
    """The plan with the fewest micro-batches per step at which every rank holds the same
    activation sets at its peaks (runtime.pipeline.generators.inflight_moments) and runs a
    forward after a backward exactly when it did: a pipeline reaches its steady state after
    a few micro-batches, and what follows repeats it (a dry run of 1,024 micro-batches would
    spend its time repeating)."""
    from dataclasses import replace

    from runtime.pipeline.generators import inflight_moments, schedule_error
    m, p, v = plan.num_microbatches, plan.pp, plan.virtual_stages

    def shape(k: int):
        moments = inflight_moments(plan.schedule, p, k, v, plan.split_backward == "record")
        return moments, tuple(max(sum(mo[:v]) for mo in rank) < k * v for rank in moments)
    target = shape(m)
    for k in range(1, m):
        if not schedule_error(plan.schedule, p, k, v) and shape(k) == target:
            return replace(plan, num_microbatches=k,
                           global_batch=plan.global_batch // m * k)
    return plan


def _with_batch(spec, global_batch: int):
    """The spec with another global batch (the same samples' shapes)."""
    from dataclasses import is_dataclass, replace
    if isinstance(spec, tuple):
        model, inputs = spec
        return model, tuple(x[:global_batch] for x in inputs)
    return replace(spec, global_batch=global_batch) if is_dataclass(spec) else spec
