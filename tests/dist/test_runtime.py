"""The pipeline runtime on real gloo ranks against one process: every schedule generator with data
or tensor parallelism beside the pipeline, gradient clipping, bf16 and fp16, a peer that dies or
hangs, the activation memory of 1F1B against GPipe, and the measured timeline.

Every rank captures the model once at one micro-batch size (MB) and deep-copies the capture per
case, so the whole matrix runs in one call on the pool; the global batch is MB x m x dp.
"""
from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass

import pytest
import torch

from passes.capture.trace import capture
from runtime.programs.stage import StageProgram, TensorSpec
from planner.api import gather_full_state
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import RunResult, assert_same_run, make_optimizer, reference_run
from runtime.pipeline.generators import SCHEDULES, make_schedule
from runtime.launch.ranks import run_local
from passes.stages.program import build_pipeline_trainer
from runtime.observe.measure import export_timelines, gather_memory, gather_timeline, simulate_like
from runtime.comm.mesh import Mesh, mesh_groups
from runtime.training.trainer import PipelineTrainer, TrainOptions
from conftest import rank_pool

CFG = get_config("gpt-tiny")  # embed + 8 blocks + head = 10 layers
MB = 2
STEPS = 3


@dataclass(frozen=True)
class Case:
    schedule: str
    p: int
    m: int
    dp: int = 1
    tp: int = 1

    @property
    def v(self) -> int:
        return 2 if self.schedule == "interleaved-1f1b" else 1

    @property
    def batch(self) -> int:
        return MB * self.m * self.dp

    def __str__(self) -> str:
        return f"{self.schedule}-p{self.p}-m{self.m}-dp{self.dp}-tp{self.tp}"


def _matrix() -> list[Case]:
    cases = []
    for name in SCHEDULES:
        for p in (2, 4):
            # Four ranks: p = 2 fills the world with dp = 2 (gpipe, interleaved) or tp = 2
            # (1f1b, zb-h1: there W re-runs the tensor-parallel collectives of the backward).
            dp, tp = (1, 1) if p == 4 else (2, 1) if name in ("gpipe", "interleaved-1f1b") \
                else (1, 2)
            cases += [Case(name, p, f * p, dp, tp) for f in (1, 2, 4)]
    return cases


CASES = _matrix()
_CAPTURED: dict[int, object] = {}


def _fresh_capture():
    """The same initial model on every rank and in the reference (seed 0), captured once."""
    if MB not in _CAPTURED:
        torch.manual_seed(0)
        model = build_model(CFG)
        _CAPTURED[MB] = capture(model, tuple(x[:MB] for x in example_batch(CFG, MB)))
    return copy.deepcopy(_CAPTURED[MB])


def _trainer(case: Case, options: TrainOptions = TrainOptions()):
    torch.set_num_threads(1)
    schedule = make_schedule(case.schedule, case.p, case.m, case.v)
    groups = mesh_groups(Mesh(case.p, case.dp, case.tp))
    return build_pipeline_trainer(_fresh_capture(), schedule, groups, make_optimizer, options)


def _train(cases: list[Case], options: TrainOptions, steps: int):
    """Runs on every rank: per case, the losses, the gradient norms and the full final
    parameters (from rank 0 only, the others return None)."""
    results = []
    for case in cases:
        trainer = _trainer(case, options)
        batch = example_batch(CFG.with_(global_batch=case.batch), case.batch)
        losses, norms = [], []
        for _ in range(steps):
            losses.append(trainer.step(*batch))
            norms.append(trainer.grad_norm)
        state = gather_full_state(trainer)
        results.append((losses, norms, state) if trainer.groups.rank == 0 else None)
    return results


@functools.cache
def _reference(batch: int, steps: int = STEPS):
    return reference_run(CFG.with_(global_batch=batch), steps)


@pytest.fixture(scope="module")
def matrix():
    # Small buckets so the data-parallel cases all-reduce several buckets per stage.
    options = TrainOptions(bucket_bytes=64 * 2**10)
    return dict(zip(CASES, rank_pool(4).run(_train, CASES, options, STEPS)[0]))


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=str)
def test_schedule_matches_one_process(matrix, case):
    losses, _, state = matrix[case]
    assert_same_run(RunResult(losses, state), _reference(case.batch), what=str(case))


RECORDED = [(Case("zb-h1", 4, 8), 0), (Case("zb-h1", 2, 4, tp=2), 0),
            (Case("zb-h1", 2, 4, dp=2), 3)]


@pytest.mark.dist
@pytest.mark.parametrize("case,zero", RECORDED, ids=lambda x: str(x))
def test_recorded_split_backward_matches_one_process(case, zero):
    """ZB-H1 whose W starts from the gradients I recorded (runtime.pipeline.split_backward),
    also under tensor parallelism and ZeRO-3 (its units gathered again for W's backward)."""
    options = TrainOptions(split_backward="record", zero=zero)
    losses, _, state = rank_pool(4).run(_train, [case], options, STEPS)[0][0]
    assert_same_run(RunResult(losses, state), _reference(case.batch), what=f"record {case}")


def _clipped_reference(batch: int, max_norm: float, steps: int):
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = make_optimizer(list(model.parameters()))
    data = example_batch(CFG.with_(global_batch=batch), batch)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*data)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.dist
def test_clipping_matches_clip_grad_norm(pool4):
    # pp x tp and pp x dp: the norm sums tp shards, pipeline stages, and counts replicas once.
    cases = [Case("1f1b", 2, 4, 1, 2), Case("interleaved-1f1b", 2, 4, 2, 1)]
    results = pool4.run(_train, cases, TrainOptions(max_norm=0.25), STEPS)[0]
    for case, (losses, norms, state) in zip(cases, results):
        ref_losses, ref_norms, ref_state = _clipped_reference(case.batch, 0.25, STEPS)
        assert min(ref_norms) > 0.25, "the test should clip"
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert_same_run(RunResult(losses, state), RunResult(tuple(ref_losses), ref_state),
                        what=str(case))


def _mixed(case: Case, options: TrainOptions, steps: int):
    """Per step: the loss, whether the step was skipped, and the loss scale it ran with."""
    trainer = _trainer(case, options)
    batch = example_batch(CFG.with_(global_batch=case.batch), case.batch)
    trace = []
    for _ in range(steps):
        scale = trainer.loss_scale
        loss = trainer.step(*batch)
        trace.append((loss, trainer.skipped, scale))
    return trace


@pytest.mark.dist
def test_bf16_trains(pool4):
    trace = pool4.run(_mixed, Case("1f1b", 4, 4), TrainOptions(precision="bf16"), 4)[0]
    losses = [loss for loss, _, _ in trace]
    reference = _reference(Case("1f1b", 4, 4).batch, 4).losses
    assert losses[-1] < losses[0] - 0.5, losses
    assert abs(losses[0] - reference[0]) < 0.02 * reference[0]  # bf16 rounding, same model


@pytest.mark.dist
def test_fp16_overflow_skips_the_step_on_every_rank(pool4):
    # This model's fp16 gradients overflow above a scale of 2**21: two skipped steps, then the
    # scale grows back every second step and overflows again.
    options = TrainOptions(precision="fp16", init_scale=2.0**23, growth_interval=2)
    per_rank = pool4.run(_mixed, Case("1f1b", 2, 4, 1, 2), options, 10)
    trace = per_rank[0]
    assert all(r == trace for r in per_rank), "ranks disagree on skipped steps"
    skipped = [s for _, s, _ in trace]
    scales = [scale for _, _, scale in trace]
    assert skipped[0], "a 2**23 loss scale must overflow fp16 gradients"
    # The dynamic scale rule, replayed from the skip flags: halve on overflow, double after
    # growth_interval good steps in a row.
    expected, good = [2.0**23], 0
    for skip in skipped[:-1]:
        good = 0 if skip else good + 1
        grow = 2 if good == 2 else 1
        expected.append(expected[-1] / 2 if skip else expected[-1] * grow)
        good %= 2
    assert scales == expected
    assert skipped.count(False) >= 4, skipped
    assert any(b > a for a, b in zip(scales, scales[1:])), "the scale never grew"
    assert trace[-1][0] < trace[skipped.index(False)][0], "fp16 training does not progress"


def _skip_keeps_params(case: Case):
    trainer = _trainer(case, TrainOptions(precision="fp16", init_scale=2.0**40))
    before = {k: v.clone() for k, v in gather_full_state(trainer).items()}
    trainer.step(*example_batch(CFG.with_(global_batch=case.batch), case.batch))
    after = gather_full_state(trainer)
    return trainer.skipped, all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.dist
def test_fp16_skipped_step_leaves_parameters(pool4):
    results = pool4.run(_skip_keeps_params, Case("gpipe", 2, 2, 2, 1))
    assert all(r == (True, True) for r in results), results


def _memory_and_timeline(schedule: str, p: int, m: int):
    case = Case(schedule, p, m)
    trainer = _trainer(case, TrainOptions(track_memory=True))
    trainer.step(*example_batch(CFG.with_(global_batch=case.batch), case.batch))
    peaks = gather_memory(trainer)
    timeline = gather_timeline(trainer)
    return peaks, timeline, trainer.schedule


@pytest.mark.dist
def test_1f1b_keeps_p_over_m_of_gpipe_activations(pool4, tmp_path):
    p, m = 4, 16
    gpipe_peaks, gpipe_timeline, schedule = pool4.run(_memory_and_timeline, "gpipe", p, m)[0]
    one_peaks, _, _ = pool4.run(_memory_and_timeline, "1f1b", p, m)[0]
    assert gpipe_peaks[0].peak_bytes > 0
    assert one_peaks[0].peak_bytes <= (p / m) * gpipe_peaks[0].peak_bytes * 1.10
    # In flight: min(p - r, m) micro-batches on rank r with 1F1B, all m with GPipe.
    assert [one_peaks[s].microbatches for s in range(p)] == pytest.approx([4, 3, 2, 1])
    assert [gpipe_peaks[s].microbatches for s in range(p)] == pytest.approx([m] * p)
    # The measured timeline has every compute action once, and exports beside the simulated one.
    computes = sorted(str(a) for acts in schedule.actions for a in acts if a.is_compute)
    assert sorted(str(e.action) for e in gpipe_timeline.events) == computes
    paths = export_timelines(gpipe_timeline, simulate_like(schedule, gpipe_timeline),
                             tmp_path / "gpipe")
    assert all((tmp_path / name).stat().st_size > 0 for name in ("gpipe.json", "gpipe.png"))
    assert len(paths) == 2


class _Produce(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.lin(x),)


class _Consume(_Produce):
    def forward(self, h, y):
        return ((self.lin(h) - y) ** 2).mean()


def _failing_peer(fate: str, timeout_s: float):
    """Two hand-made stages (no capture: the ranks must reach the failure well within the
    launcher's wait). Rank 0 never sends: it raises at once, or hangs past the timeout."""
    spec = TensorSpec((2, 4), torch.float32)
    trace = torch.fx.symbolic_trace
    programs = [StageProgram(0, trace(_Produce()), ("x",), (), ("h",), (), (spec,)),
                StageProgram(1, trace(_Consume()), ("y",), ("h",), ("__loss__",), (spec,), ())]
    groups = mesh_groups(Mesh(2, 1, 1))
    trainer = PipelineTrainer({groups.pp_index: programs[groups.pp_index]},
                              make_schedule("1f1b", 2, 2), groups, ("x", "y"), make_optimizer)
    if groups.rank == 0:
        if fate == "hangs":
            time.sleep(timeout_s + 1)
        raise RuntimeError(f"injected failure: rank 0 {fate} before its first send")
    trainer.step(torch.randn(4, 4), torch.randn(4, 4))


@pytest.mark.dist
@pytest.mark.parametrize("fate", ["dies", "hangs"])
def test_failed_peer_gives_a_clear_error_not_a_hang(fate):
    timeout_s = 5  # the process-group timeout: a hung peer is reported after this
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        run_local(_failing_peer, 2, (fate, timeout_s), timeout_s=timeout_s)
    text = str(err.value)
    assert "injected failure" in text
    explained = ("PeerError: rank 1 waiting for 1RECV_F0 from rank 0 failed" in text
                 and "probably died or is stuck" in text)
    if fate == "dies":  # rank 1 explains its wait, unless the launcher ended it first
        assert explained or "rank 1 was still running" in text, text
    else:  # rank 1's wait times out while rank 0 sleeps; rank 0's own error is the cause
        assert explained and text.startswith("rank 0 failed"), text
    assert time.perf_counter() - start < 60
