"""A dry run: one rank's real programs for one training step on fake tensors, on one CPU.

The rank joins a fake process group (torch.distributed's "fake" backend: collectives return at
once, nothing is sent) of the plan's world size as the rank it is asked to be, builds its shard
under a FakeTensorMode (tensors with shapes and no data: a 70B model's shard costs nothing), and
trains under a runtime.observe.memory_tracker MemoryTracker counting that mode's tensors. What
the programs allocate and free is what a real rank's would; only values are missing, so a
step's scalars (a loss read with .item(), a count of targets) read as 1 and a branch on a value
takes that side, and a collective that exchanges Python objects (all_gather_object: which
stages hold a tied weight, for one) answers every rank's share with this rank's own.
"""
from __future__ import annotations

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
                 model=None):
    """Rank `rank` of `plan` for `steps` training steps on fake tensors (module docstring):
    its planner.bench.memory.RankMemory. `spec` builds the model (a preset config or an HFSpec,
    as planner.training.local.build takes), or `model` is the module itself (meta or real)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.api import ParallelModel
    from planner.bench.memory import RankMemory, mark_state, meta_model
    from runtime.comm.collectives import fake_run
    from runtime.observe.memory_tracker import MemoryTracker
    from runtime.training.trainer import TrainOptions

    if dist.is_initialized():
        raise RuntimeError("a dry run joins a fake process group of its own; run it outside "
                           "a distributed launch (torchrun), where no group is set up")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.gpus)
    gather = dist.all_gather_object
    dist.all_gather_object = _own_object
    try:
        meta, batch_fn = meta_model(spec, lazy_batch=True) if model is None else (model, None)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # The dispatch cache may answer an op that returns a view with a tensor of a storage
        # of its own, which the tracker would count as memory the real op never takes.
        fake.cache_enabled = False
        tracker = MemoryTracker(fake_mode=fake)
        with fake, AnyScalar(), fake_run():
            batch = batch_fn() if batch_fn else _batch_like(plan, model)
            with tracker:
                pm = ParallelModel(meta, plan, [], batch,
                                   lambda params: torch.optim.AdamW(params, lr=1e-4),
                                   options=TrainOptions(**(options or {})))
                trainer = pm.shard()
                mark_state(tracker, trainer)
                tracker.mark_unmarked("other")
                tracker.watch_optimizer(trainer.optimizer)
                tracker.reset_peak()
                for _ in range(steps):
                    pm.train_step(*batch)
                    mark_state(tracker, trainer)
        return RankMemory(rank, tracker.peak_bytes, tracker.split())
    finally:
        dist.all_gather_object = gather
        dist.destroy_process_group()


def _own_object(out: list, obj, group=None) -> None:
    """all_gather_object in a dry run: the fake group sends nothing, so every share is ours."""
    out[:] = [obj] * len(out)


def _batch_like(plan, model):
    raise ValueError("a dry run of a module needs its spec (the model and a batch to build)")


def dry_run(spec, plan, options: dict | None = None, ranks=None, steps: int = 2) -> list:
    """Every rank of `plan` (or those in `ranks`) dry-run in turn: one RankMemory each."""
    return [dry_run_rank(spec, plan, r, options, steps)
            for r in (range(plan.gpus) if ranks is None else ranks)]
