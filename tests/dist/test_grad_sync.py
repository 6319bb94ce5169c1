"""Data-parallel gradient collectives started inside the backward, as DistributedDataParallel
starts them (runtime.training.trainer._GradSync at zero 0, runtime.data_parallel.sharded_dp at
zero 1), on real gloo ranks: dp=4 with one stage trains as one process does, every bucket's
collective starts before the stage's backward is over (so it overlaps the rest of it), and a
parameter that gets no gradient still sums to zero.

(tests/dist/test_runtime.py covers zero 0 beside pipelines, tests/dist/test_sharded_dp.py zero
1-3 on every mesh; both compare against one process.)
"""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import rank_pool
from planner.api import gather_full_state
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import RunResult, assert_same_run, make_optimizer, reference_run

CFG = get_config("gpt-tiny").with_(layers=2)
STEPS = 2


def _train(zero: int, m: int, bucket_bytes: int | None):
    """Per rank: (losses, full final state on rank 0, buckets started early / all per step)."""
    import torch.distributed as dist

    from passes.capture.trace import capture
    from passes.stages.program import build_pipeline_trainer
    from runtime.comm.mesh import Mesh, mesh_groups
    from runtime.pipeline.generators import make_schedule
    from runtime.training.trainer import TrainOptions

    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch_size = 4 * 2 * m
    config = CFG.with_(global_batch=batch_size)
    batch = example_batch(config, batch_size)
    captured = capture(build_model(config), tuple(x[:2] for x in batch))
    trainer = build_pipeline_trainer(copy.deepcopy(captured), make_schedule("gpipe", 1, m),
                                     mesh_groups(Mesh(1, 4, 1)), make_optimizer,
                                     TrainOptions(zero=zero, bucket_bytes=bucket_bytes))
    early = []
    if zero == 0:
        sync, start = trainer.sync, trainer.sync.start
        # started before the executor reports the stage done, of how many buckets
        trainer.sync.start = lambda stage: (early.append((sync._next, len(sync._order))),
                                            start(stage))[-1]
    else:
        sharded, done = trainer.sharded, trainer.sharded.stage_done
        trainer.sharded.stage_done = lambda stage: (early.append(
            (sum(b.reduced for b in sharded.buckets), len(sharded.buckets))), done(stage))[-1]
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    state = gather_full_state(trainer)
    return losses, state if dist.get_rank() == 0 else None, early


@pytest.mark.dist
@pytest.mark.parametrize("zero,m,bucket_bytes",
                         [(0, 1, 16 * 2**10), (0, 2, 16 * 2**10), (1, 2, None)])
def test_collectives_start_in_backward_and_match_one_process(zero, m, bucket_bytes):
    results = rank_pool(4).run(_train, zero, m, bucket_bytes)
    losses, state, early = results[0]
    assert_same_run(RunResult(tuple(losses), state), reference_run(
        CFG.with_(global_batch=4 * 2 * m), STEPS), what=f"zero={zero} m={m}")
    for _, _, per_step in results:
        assert len(per_step) == STEPS
        for started, total in per_step:
            assert total > 1 and started == total, per_step


def _unused_worker():
    """Two parameters, one never used: its bucket starts when the stage is done, at zero."""
    import torch.distributed as dist

    from runtime.training.trainer import _GradSync

    rank = dist.get_rank()
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    sync = _GradSync({0: [used, unused]}, dist.group.WORLD, 8, rank, {0: 2})
    out = []
    for step in range(2):
        sync.zero()
        for mb in range(2):
            ((used * (rank + 1 + mb + step)).sum()).backward()
        started = sync._next
        sync.start(0)
        sync.wait()
        out.append((started, used.grad.clone(), unused.grad.clone()))
    return out


@pytest.mark.dist
def test_unused_parameter_waits_for_stage_done_and_sums_to_zero():
    per_rank = rank_pool(2).run(_unused_worker)
    for out in per_rank:
        for step, (started, used, unused) in enumerate(out):
            # buckets: [unused] then [used] (reverse order, 8 bytes each): the first never
            # completes by its hooks, so neither starts before the stage is done
            assert started == 0
            want = sum(rank + 1 + mb + step for rank in range(2) for mb in range(2))
            torch.testing.assert_close(used, torch.full((3,), float(want)))
            torch.testing.assert_close(unused, torch.zeros(2))
