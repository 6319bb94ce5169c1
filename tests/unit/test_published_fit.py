"""The published runs' profiles and the fit of named constants on them
(planner.bench.published, planner.bench.published_fit): the fit recovers a constant that made
the "measured" times, on a small preset."""
import dataclasses

import pytest

from cost_model.hardware.cluster import get_cluster
from planner.bench import published as pub
from planner.bench import published_fit as fit
from planner.search.meshes import Request
from planner.search.plan import GiB

TINY = pub.ModelSpec("Tiny", preset="gpt-tiny")


def _row(**changes) -> pub.Row:
    base = pub.Row("t.csv", 9, "Tiny", gpus=8, gbs=32, mbs=2, seq=64, tp=1, pp=2, cp=1, ep=None,
                   vp=None, fsdp=None, kernels="eager", step_s=1.0, tokens_per_s_per_gpu=1.0)
    return dataclasses.replace(base, **changes)


def test_each_file_names_the_hardware_its_rows_ran_on():
    rows = {path.name: pub.read_rows(path) for path in pub.csv_files()}
    assert {r.cluster for r in rows["h100-bf16-torchtitan.csv"]} == {"h100-grand-teton"}
    assert {r.cluster for r in rows["h100-bf16.csv"]} == {"h100-sxm-dgx"}  # the default


@pytest.mark.parametrize("lines, words", [
    ("# cluster: tpu-v5\n", "'# cluster: tpu-v5' is not a cluster preset"),
    ("# cluster: h100-sxm-dgx\n# cluster: a100-80g-dgx\n", "2 '# cluster:' lines"),
])
def test_a_bad_cluster_line_is_one_line_naming_the_file(tmp_path, lines, words):
    path = tmp_path / "runs.csv"
    path.write_text(lines + ",".join(pub.COLUMNS) + "\n")
    with pytest.raises(ValueError, match=words) as err:
        pub.read_rows(path)
    assert "runs.csv" in str(err.value)


def test_only_eager_runs_keep_one_kernel_per_pointwise_op():
    assert not _row(kernels="eager").fused_kernels
    assert all(_row(kernels=k).fused_kernels for k in ("torch.compile", "TE + DeepEP",
                                                       "Megatron-Core (NeMo 25.11)"))


def test_golden_section_finds_the_minimum_of_a_kinked_function():
    assert fit._golden(lambda x: abs(x - 0.537) + 0.1 * max(0.0, x - 0.6), 0.3, 0.9) == \
        pytest.approx(0.537, abs=0.006)


def test_fit_names_are_checked():
    assert fit.parse_names("matmul_eff, attention_eff") == ("matmul_eff", "attention_eff")
    with pytest.raises(ValueError, match="--fit takes a comma-separated list of matmul_eff"):
        fit.parse_names("matmul_eff,clock")


def test_the_fit_recovers_the_constant_that_made_the_times():
    """Rows whose 'published' times are fxpar's own at matmul_eff 0.4: the fit finds 0.4 again,
    with nothing left to explain."""
    truth = dataclasses.replace(get_cluster("h100-sxm-dgx"), matmul_eff=0.4)
    rows = [_row(gbs=gbs, pp=pp) for gbs, pp in ((32, 2), (64, 1), (128, 4))]
    rows = [dataclasses.replace(r, step_s=pub.price(r, TINY, truth).predicted_s) for r in rows]
    result, fitted = fit.fit_cluster(rows, "h100-sxm-dgx", ("matmul_eff",),
                                     specs={"Tiny": TINY})
    start = get_cluster("h100-sxm-dgx").matmul_eff
    assert result.before == (("matmul_eff", start),) and result.rows == 3
    assert fitted.matmul_eff == pytest.approx(0.4, abs=0.01)
    assert result.loss_after < 0.01 < result.loss_before
    assert f"matmul_eff {start:.3f} -> 0.4" in fit.fit_text(result)


def test_a_run_fxpar_thinks_too_big_is_priced_with_a_memory_note():
    costs, name, batch, seq = pub.model_costs(TINY, 32, 64)
    hw = get_cluster("h100-sxm-dgx")
    fix = {"tp": 1, "pp": 2, "mb": 2, "recompute": "full", "zero": 0}
    free = pub._best(costs, Request(8, hw, batch, seq, float(hw.mem_bytes), name, fix, top_k=1))
    need = free[0].predicted.peak_memory_bytes
    tight = Request(8, hw, batch, seq, need / 1.2, name, fix, top_k=1)
    best, note = pub._best(costs, tight)
    assert free[1] == "" and best.predicted.iteration_s == free[0].predicted.iteration_s
    assert f"{need / GiB:.1f} GiB per device, above the {need / 1.2 / GiB:.1f} GiB" in note


def test_the_simplex_follows_a_valley_one_constant_at_a_time_would_stop_in():
    """Two constants that trade against each other (a diagonal valley): the simplex reaches the
    minimum at (0.6, 0.75) from (0.45, 1.0), inside the bounds."""
    valley = lambda p: abs(p[0] + p[1] - 1.35) + 0.2 * abs(p[0] - 0.6)  # noqa: E731
    best = fit._simplex(valley, [0.45, 1.0], [(0.3, 0.9), (0.4, 1.0)], evaluations=120)
    assert best == pytest.approx([0.6, 0.75], abs=0.02)
    assert valley(best) < 0.01
