"""The ZeRO level as a search axis: llama2-7b on 8 H100s priced beside a torchtitan-like FSDP
configuration (dp=8, zero=3) and a Megatron-like one (tp=8), a model that fits only with ZeRO-3,
the memory split per level against cost_model.layers.memory's per-parameter counts, and bad fixes."""
from __future__ import annotations

import pytest

from cost_model.layers.memory import TrainingMemory
from cost_model.layers.sharding import Sharding, padded, step_traffic, sync_terms
from planner.api import plan
from planner.cli import main
from planner.search.costs import PlanningError

H100 = "h100-sxm-dgx"


@pytest.fixture(scope="module")
def llama_on_8():
    best = plan("llama2-7b", 8, cluster=H100)[0]
    titan = plan("llama2-7b", 8, cluster=H100,
                 fix={"dp": 8, "tp": 1, "pp": 1, "zero": 3, "dp_shard": 8})[0]
    megatron = plan("llama2-7b", 8, cluster=H100,
                    fix={"dp": 1, "tp": 8, "pp": 1, "zero": 0, "strategy": "tp"})[0]
    return best, titan, megatron


def test_planner_never_slower_than_torchtitan_or_megatron(llama_on_8):
    best, titan, megatron = llama_on_8
    assert (titan.dp, titan.zero, titan.dp_shard or titan.dp) == (8, 3, 8)
    assert (megatron.tp, megatron.zero) == (8, 0)
    assert best.predicted.iteration_s <= titan.predicted.iteration_s
    assert best.predicted.iteration_s <= megatron.predicted.iteration_s
    assert "zero=3" in str(titan).splitlines()[1]  # the mesh line names the level


def test_fsdp_memory_split_follows_the_level(llama_on_8):
    """Under ZeRO-3 over 8 ranks the weights+gradients and optimizer columns are an eighth of
    the replicated figures (plus the transient whole layers in params+grads)."""
    _, titan, _ = llama_on_8
    replicated = plan("llama2-7b", 8, cluster=H100, memory_limit=1000,
                      fix={"dp": 8, "tp": 1, "pp": 1, "zero": 0, "mb": titan.micro_batch,
                           "recompute": "none"})[0]
    stage, whole = titan.stages[0], replicated.stages[0]
    assert stage.optimizer_bytes == pytest.approx(whole.optimizer_bytes / 8, rel=1e-9)
    assert whole.param_bytes / 8 < stage.param_bytes < whole.param_bytes / 4


def test_a_model_that_fits_only_with_zero3_is_planned_with_it():
    fix = {"tp": 1, "pp": 1}
    for level in (0, 1, 2):
        with pytest.raises(PlanningError, match="no plan fits in 20.00 GiB"):
            plan("llama2-7b", 8, cluster=H100, memory_limit=20, fix={**fix, "zero": level})
    chosen = plan("llama2-7b", 8, cluster=H100, memory_limit=20, fix=fix)[0]
    assert chosen.zero == 3
    assert chosen.predicted.peak_memory_bytes <= 20 * 2**30


def test_zero1_flag_is_zero_level_1():
    a = plan("gpt2-small", 8, cluster=H100, zero1=True)[0]
    b = plan("gpt2-small", 8, cluster=H100, fix={"zero": 1})[0]
    assert a == b and a.zero == 1
    with pytest.raises(ValueError, match="zero1 contradicts zero=2"):
        plan("gpt2-small", 8, cluster=H100, zero1=True, fix={"zero": 2})


@pytest.mark.parametrize("fix, message", [
    ({"zero": 4}, "zero must be one of 0, 1, 2, 3"),
    ({"zero": 0, "dp_shard": 2}, "zero=0 does not"),
    ({"dp": 4, "dp_shard": 3}, "dp_shard=3 does not divide dp=4"),
    ({"dp_shard": 0}, "dp_shard must be a positive integer"),
])
def test_bad_fixes_are_named(fix, message):
    with pytest.raises(ValueError, match=message):
        plan("gpt2-small", 8, cluster=H100, fix=fix)


def test_cli_fix_zero(capsys):
    assert main(["plan", "--model", "gpt2-small", "--gpus", "8", "--cluster", H100,
                 "--fix", "dp=8,zero=3,dp_shard=4"]) == 0
    out = capsys.readouterr().out
    assert "zero=3, shard 4 x replicate 2" in out
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "gpt2-small", "--gpus", "8", "--fix", "zero=x"])
    assert exit_.value.code == 2
    assert "bad item 'zero=x': zero must be one of 0, 1, 2, 3" in capsys.readouterr().err


def test_level_memory_matches_the_zero_paper_counts():
    """Rajbhandari et al. 2020, figure 1: mixed-precision Adam, K = 12, per parameter on one
    of N_d ranks: 2+2+K (baseline), 2+2+K/N_d (P_os), 2+(2+K)/N_d (P_os+g), (2+2+K)/N_d."""
    t, nd = TrainingMemory.for_dtype(2), 64
    k = t.optimizer_bytes()
    assert k == 12
    want = [2 + 2 + k, 2 + 2 + k / nd, 2 + (2 + k) / nd, (2 + 2 + k) / nd]
    for level, expected in enumerate(want):
        fw, fg, fo = Sharding(level, nd).fractions()
        assert 2 * fw + 2 * fg + k * fo == pytest.approx(expected)


def test_traffic_of_each_level_against_the_ring_formulas():
    """Per step, n ranks, one unit of M gradient bytes (padded): level 0 all-reduces 2(n-1)/n·M;
    level 1 reduce-scatters and all-gathers (n-1)/n·M once each; level 2 reduce-scatters per
    micro-batch; level 3 also gathers before each forward and backward of each micro-batch."""
    n, m, numel = 4, 3, 1001
    full = padded(numel, n) * 4
    ring = (n - 1) / n * full
    assert step_traffic([(numel, 4, 4, 1)], Sharding(0, n, 1, m))["all_reduce"] == \
        pytest.approx(2 * (n - 1) / n * numel * 4)
    one = step_traffic([(numel, 4, 4, 1)], Sharding(1, n, 1, m))
    assert (one["reduce_scatter"], one["all_gather"]) == pytest.approx((ring, ring))
    assert step_traffic([(numel, 4, 4, 1)], Sharding(2, n, 1, m))["reduce_scatter"] == \
        pytest.approx(m * ring)
    three = step_traffic([(numel, 4, 4, 2)], Sharding(3, n, 1, m, 2))
    assert three["all_gather"] == pytest.approx(m * 3 * ring)
    assert sync_terms(Sharding(0, n), 1.0, 1, 1, 1, 1, 0.5, 2.0, 0.25, 10) == (0.375, 1.5)


def test_sync_parts_keep_what_compute_can_hide_apart_from_what_it_cannot():
    from cost_model.layers.sharding import BACKWARD_SHARE, sync_parts
    # level 3, 4 micro-batches, 2 replicate groups: gathers and reduce-scatters run beside all
    # of every micro-batch; the replicate all-reduce after the last backward does not
    p = sync_parts(Sharding(3, 4, 2, 4), 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, units=10)
    gathers = 4 * 2  # m x (forward + backward)
    assert (p.hide_alpha, p.hide_slope) == (10 * 4 * 1.0 + 10 * gathers * 3.0,
                                            4 * 2.0 + gathers * 4.0 * 0.5)
    assert (p.alpha, p.slope, p.beside) == (10 * 5.0, 6.0 / 4, 4.0)
    # level 1: the gather after the optimizer step has nothing beside it
    one = sync_parts(Sharding(1, 4, 1, 4), 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, units=10)
    assert (one.alpha, one.slope) == (10 * 3.0, 4.0 * 0.5)
    assert one.beside == pytest.approx(BACKWARD_SHARE)
