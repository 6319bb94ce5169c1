"""The published runs' profiles, the fit of the runtime profiles' two terms on them and the
leave-one-source-out check (planner.bench.published, planner.bench.published_fit): a fit
recovers the terms that made the "measured" times on a small preset, and a source left out is
priced with terms fitted without it."""
import dataclasses

import pytest

from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.runtimes import PRIORS, RUNTIMES, with_fitted
from planner.bench import published as pub
from planner.bench import published_fit as fit
from planner.search.meshes import Request
from planner.search.plan import GiB

TINY = pub.ModelSpec("Tiny", preset="gpt-tiny")
SMALL = pub.ModelSpec("Small", preset="gpt2-small")   # large enough for its GEMMs to show
SPECS = {"Tiny": TINY, "Small": SMALL}


def _row(**changes) -> pub.Row:
    base = pub.Row("t.csv", 9, "Tiny", gpus=8, gbs=32, mbs=2, seq=64, tp=1, pp=2, cp=1, ep=None,
                   vp=None, fsdp=None, kernels="eager", step_s=1.0, tokens_per_s_per_gpu=1.0,
                   runtime="torchtitan")
    return dataclasses.replace(base, **changes)


def test_each_file_names_the_hardware_its_rows_ran_on():
    rows = {path.name: pub.read_rows(path) for path in pub.csv_files()}
    assert {r.cluster for r in rows["h100-bf16-torchtitan.csv"]} == {"h100-grand-teton"}
    assert {r.cluster for r in rows["h100-bf16.csv"]} == {"h100-sxm-dgx"}  # the default
    assert {r.cluster for r in rows["llmf-a100-40.csv"]} == {"a100-40g-dgx"}
    assert {r.runtime for r in rows["h100-bf16-torchtitan.csv"]} == {"torchtitan",
                                                                     "torchtitan-compile"}


@pytest.mark.parametrize("lines, words", [
    ("# cluster: tpu-v5\n", "'# cluster: tpu-v5' is not a cluster preset"),
    ("# cluster: h100-sxm-dgx\n# cluster: a100-80g-dgx\n", "2 '# cluster:' lines"),
    ("# runtime: deepspeed\n", "'# runtime: deepspeed' is not one of fxpar, megatron"),
])
def test_a_bad_header_line_is_one_line_naming_the_file(tmp_path, lines, words):
    path = tmp_path / "runs.csv"
    path.write_text(lines + ",".join(pub.COLUMNS) + "\n")
    with pytest.raises(ValueError, match=words) as err:
        pub.read_rows(path)
    assert "runs.csv" in str(err.value)


def test_a_row_names_its_attention_kernel_or_keeps_its_runtimes():
    assert _row(kernels="TE + DeepEP + FlexAttn").attention == "flex"
    assert _row(kernels="eager + triton flash attention").attention == "triton"
    assert _row(kernels="SDPA FlashAttention-2").attention == "fa2"
    assert _row(kernels="TE + DeepEP").attention is None
    hw = get_cluster("h100-sxm-dgx")
    flex = pub.run_cluster(_row(kernels="FlexAttn", runtime="automodel"), hw)
    own = pub.run_cluster(_row(kernels="TE", runtime="automodel"), hw)
    assert flex.attention_eff == pytest.approx(own.attention_eff * 0.51)


def _made_by(terms: tuple[float, float], rows) -> list[pub.Row]:
    """The rows with the times fxpar predicts for them under the fsdp family at `terms`."""
    runtimes = fit.family_runtimes("fsdp", terms)
    return [dataclasses.replace(r, step_s=pub.price(r, SPECS[r.model], r.cluster,
                                                    runtimes).predicted_s) for r in rows]


def test_the_fit_recovers_the_terms_that_made_the_times():
    """Rows whose 'published' times are fxpar's own at compute_share 0.6 and 20 us a launch,
    small and large enough that both terms show: the fit finds them again."""
    rows = _made_by((0.6, 20e-6), [_row(gbs=16, mbs=1, pp=1, fsdp=8, seq=64)] +
                    [_row(model="Small", gbs=gbs, mbs=mbs, pp=1, fsdp=8, seq=1024)
                     for gbs, mbs in ((64, 8), (128, 16))])
    result = fit.fit_family("fsdp", rows, SPECS)
    assert result.before == (1.0, PRIORS["fxpar"].host_op_s) and result.rows == 3
    assert result.after == pytest.approx((0.6, 20e-6), rel=0.05)
    assert result.loss_after < 0.02 < result.loss_before
    assert f"compute_share 1.000 -> {result.after[0]:.3f}" in fit.fit_text(result)


def test_a_fused_member_of_a_family_launches_in_its_share_of_an_eager_ones_time():
    eager, fused = (with_fitted(PRIORS[n], 0.7, 10e-6) for n in ("torchtitan",
                                                               "torchtitan-compile"))
    assert (eager.compute_share, eager.host_op_s) == (0.7, 10e-6)
    assert fused.host_op_s == pytest.approx(10e-6 * PRIORS["torchtitan-compile"].host_op_s /
                                            PRIORS["torchtitan"].host_op_s)


def test_a_source_left_out_is_priced_with_terms_fitted_without_it():
    """Two sources made at different terms: each left out is priced with the other's fit, so
    its error is the gap between the two, not zero."""
    small = dict(model="Small", pp=1, fsdp=8, seq=1024, mbs=8)
    a = [dataclasses.replace(r, source="a.csv") for r in _made_by(
        (0.6, 8e-6), [_row(gbs=g, **small) for g in (64, 128, 256)])]
    b = [dataclasses.replace(r, source="b.csv") for r in _made_by(
        (0.8, 8e-6), [_row(gbs=g, **small) for g in (128, 256, 512)])]
    folds = fit.cross_validate(a + b, SPECS)
    assert [f.source for f in folds] == ["a.csv", "b.csv"]
    assert all(f.fits[0].after[0] == pytest.approx(share, abs=0.03)
               for f, share in zip(folds, (0.8, 0.6)))
    left_out_a = [r.error_pct for r in folds[0].results]
    assert all(e < -10 for e in left_out_a)           # priced at 0.8 where 0.6 made them
    assert fit.median_error(folds[1].results) > 10


def test_a_family_with_fewer_rows_left_than_terms_keeps_its_priors():
    """None left, or two (fit.MIN_ROWS = 3): two constants are not fitted on them."""
    made = _made_by((0.6, 8e-6), [_row(pp=1, fsdp=8, gbs=g) for g in (16, 32, 64)])
    rows = [dataclasses.replace(r, source=source, runtime="megatron")
            for r, source in zip(made, ("one.csv", "two.csv", "two.csv"))]
    one, two = fit.cross_validate(rows, SPECS)
    assert one.fits == () and two.fits == ()
    for fold in (one, two):
        row = fold.results[0].row
        again = pub.price(row, TINY, row.cluster, dict(PRIORS))
        assert fold.results[0].predicted_s == pytest.approx(again.predicted_s)


def test_every_runtime_has_its_fitted_family_terms():
    assert set(RUNTIMES) == set(PRIORS)
    for name, rt in RUNTIMES.items():
        assert 0.4 <= rt.compute_share <= 1.0 and rt.host_op_s >= 0, name


def test_a_run_fxpar_thinks_too_big_is_priced_with_a_memory_note():
    costs, name, batch, seq = pub.model_costs(TINY, 32, 64)
    hw = get_cluster("h100-sxm-dgx")
    fix = {"tp": 1, "pp": 2, "mb": 2, "recompute": "full", "zero": 0}
    free = pub._best(costs, Request(8, hw, batch, seq, float(hw.mem_bytes), name, fix, top_k=1))
    need = free[0].predicted.peak_memory_bytes
    tight = Request(8, hw, batch, seq, need / 1.2, name, fix, top_k=1)
    best, note = pub._best(costs, tight)
    assert free[1] == "" and best.predicted.iteration_s == free[0].predicted.iteration_s
    assert f"{need / GiB:.1f} GiB per device (parameters " in note      # then term by term
    assert f"above the {need / 1.2 / GiB:.1f} GiB it has" in note


def test_the_simplex_follows_a_valley_one_constant_at_a_time_would_stop_in():
    """Two constants that trade against each other (a diagonal valley): the simplex reaches the
    minimum at (0.6, 0.75) from (0.45, 1.0), inside the bounds."""
    valley = lambda p: abs(p[0] + p[1] - 1.35) + 0.2 * abs(p[0] - 0.6)  # noqa: E731
    best = fit._simplex(valley, [0.45, 1.0], [(0.3, 0.9), (0.4, 1.0)], evaluations=120)
    assert best == pytest.approx([0.6, 0.75], abs=0.02)
    assert valley(best) < 0.01
