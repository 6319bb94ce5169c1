"""The executor and trainer in one process (one pipeline rank, no communication) against plain
PyTorch, and the saved-activation counter."""
from __future__ import annotations

import copy

import pytest
import torch

from passes.capture.trace import capture
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import make_optimizer
from runtime.pipeline.generators import make_schedule
from passes.stages.program import build_pipeline_trainer
from runtime.observe.measure import balanced_stage_sizes
from runtime.training.activation_memory import SavedActivations
from runtime.comm.mesh import Mesh, RankGroups
from runtime.training.trainer import TrainOptions

CFG = get_config("gpt-tiny").with_(layers=2, global_batch=8)  # embed + 2 blocks + head
SOLO = RankGroups(Mesh(1, 1, 1), 0)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return capture(build_model(CFG), tuple(x[:2] for x in example_batch(CFG, 2)))


def _reference(steps: int, max_norm: float | None = None):
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = make_optimizer(list(model.parameters()))
    batch = example_batch(CFG, CFG.global_batch)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, dict(model.named_parameters())


def _run(captured, name: str, v: int, steps: int, options: TrainOptions = TrainOptions()):
    schedule = make_schedule(name, 1, 4, v)
    trainer = build_pipeline_trainer(copy.deepcopy(captured), schedule, SOLO, make_optimizer,
                                     options)
    batch = example_batch(CFG, CFG.global_batch)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(trainer.step(*batch))
        norms.append(trainer.grad_norm)
    params = {n: p for prog in trainer.programs.values() for n, p in prog.gm.named_parameters()}
    return losses, norms, params, trainer


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                    ("interleaved-1f1b", 2)])
def test_one_rank_matches_plain_pytorch(captured, name, v):
    # interleaved with p=1, v=2: two stages on one rank, handing data over in memory.
    losses, _, params, trainer = _run(captured, name, v, 3)
    ref_losses, _, ref_params = _reference(3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for n, value in ref_params.items():
        torch.testing.assert_close(params[n], value, rtol=1e-5, atol=1e-6)
    kinds = {e.action.kind.value for e in trainer.timeline().events}
    assert kinds == ({"F", "I", "W"} if name == "zb-h1" else {"F", "B"})


def test_clipping_matches_clip_grad_norm(captured):
    losses, norms, params, _ = _run(captured, "1f1b", 1, 3, TrainOptions(max_norm=0.3))
    ref_losses, ref_norms, ref_params = _reference(3, max_norm=0.3)
    assert min(ref_norms) > 0.3
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for n, value in ref_params.items():
        torch.testing.assert_close(params[n], value, rtol=1e-5, atol=1e-6)


def test_saved_activations_are_counted_while_alive():
    layer = torch.nn.Linear(64, 64)
    memory = SavedActivations([layer])
    x = torch.randn(8, 64)
    with memory.saving(0, ignore=[x]):
        h = torch.relu(layer(x))  # saves relu's output (the input x and weight are ignored)
        y = (h * h).sum()         # saves h again: one storage, counted once
    assert memory.current[0] == memory.last_forward[0] == 8 * 64 * 4
    y.backward()
    del y, h
    assert memory.current[0] == 0 and memory.total == 0
    assert memory.peak[0] == memory.total_peak == 8 * 64 * 4


def test_options_are_checked():
    with pytest.raises(ValueError, match="precision"):
        TrainOptions(precision="fp8")
    with pytest.raises(ValueError, match="max_norm"):
        TrainOptions(max_norm=0.0)
    with pytest.raises(ValueError, match="recv_ahead"):
        TrainOptions(recv_ahead=-1)
    with pytest.raises(ValueError, match="split_backward must be auto or one of retraverse, record"):
        TrainOptions(split_backward="recompute")


def test_balanced_stage_sizes():
    assert balanced_stage_sizes(10, 4) == (3, 3, 2, 2)
    assert balanced_stage_sizes(10, 8) == (2, 2, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        balanced_stage_sizes(3, 4)


def test_gradient_buckets_default_to_distributed_data_parallels_sizes():
    """1 MiB for the first bucket (the last parameters: backward finishes them first), then up to
    25 MiB each, in reverse order; a set bucket_bytes caps every bucket."""
    from runtime.training.trainer import _GradSync

    mib = 2**20 // 4  # float32 elements in a MiB
    params = [torch.nn.Parameter(torch.zeros(n)) for n in
              (10 * mib, 10 * mib, 10 * mib, mib // 2, mib // 2, mib // 2)]
    buckets = _GradSync._split(params, None, 0)
    assert [[p.numel() // (mib // 2) for p in b.params] for b in buckets] == [[1, 1], [1, 20, 20],
                                                                              [20]]
    capped = _GradSync._split(params, 11 * 2**20, 0)
    assert [len(b.params) for b in capped] == [3, 1, 1, 1]
