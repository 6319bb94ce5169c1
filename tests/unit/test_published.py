"""The published measured runs (planner.bench.published, `fxpar validate`): the CSV files parse and
name their source, every row maps to a model, a row's fixed configuration is what its columns say,
and the error, summary and ranking arithmetic. Nothing here prices a large model."""
import dataclasses
import json
import pathlib
import tomllib

import pytest

from planner.bench import published as pub
from planner.bench import published_report as report_of
from planner.cli import main
from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.runtimes import RUNTIMES
from planner.models.presets import PRESETS, get_config
from planner.search.meshes import check_fix

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = [r for path in pub.csv_files() for r in pub.read_rows(path)]


def _row(**changes) -> pub.Row:
    base = pub.Row("t.csv", 9, "M", gpus=8, gbs=16, mbs=2, seq=1024, tp=1, pp=1, cp=1, ep=None,
                   vp=None, fsdp=8, kernels="k", step_s=10.0, tokens_per_s_per_gpu=100.0)
    return dataclasses.replace(base, **changes)


def _find(model: str, gpus: int) -> pub.Row:
    return next(r for r in ROWS if r.model == model and r.gpus == gpus)


def test_every_csv_parses_and_opens_with_its_source():
    files = pub.csv_files()
    for path in files:
        head = path.read_text().splitlines()
        comments = [line for line in head if line.startswith("#")]
        assert head[0].startswith("#") and any("Source:" in line for line in comments), path
        assert pub.read_rows(path), path
    assert len(ROWS) >= 220
    # every row names the runtime that ran it, one of the runtime profiles
    assert {r.runtime for r in ROWS} <= set(RUNTIMES) and "fxpar" not in {r.runtime for r in ROWS}


def test_the_first_table_is_the_published_copy():
    shared = pub.read_rows(pub.FOLDER / "h100-bf16.csv")
    assert [(r.model, r.gpus, r.step_s) for r in shared][:2] == [
        ("DeepSeek V3 671B", 1024, 37.87), ("DeepSeek V3 671B", 256, 8.18)]


def test_every_row_maps_to_a_model_fxpar_can_build():
    specs = pub.load_models()
    assert {r.model for r in ROWS} <= set(specs)
    for spec in specs.values():
        assert spec.note
        if spec.unsupported:
            continue
        if spec.preset:
            assert spec.preset in PRESETS
            get_config(spec.preset, **dict(spec.overrides))  # overrides are ModelConfig fields
        else:
            config = json.loads((pub.FOLDER / spec.hf_config).read_text())
            assert isinstance(config["model_type"], str)
            pub._hf_module(str(pub.FOLDER / spec.hf_config))  # builds as `fxpar plan` would


def test_model_sizes_against_the_public_configs():
    specs = pub.load_models()
    llama3 = get_config(specs["Llama3 70B"].preset, **dict(specs["Llama3 70B"].overrides))
    assert (llama3.layers, llama3.hidden, llama3.heads, llama3.n_kv_heads, llama3.ffn_hidden,
            llama3.vocab) == (80, 8192, 64, 8, 28672, 128256)
    v3 = json.loads((pub.FOLDER / specs["DeepSeek V3 671B"].hf_config).read_text())
    assert (v3["num_hidden_layers"], v3["hidden_size"], v3["num_attention_heads"],
            v3["vocab_size"], v3["n_routed_experts"], v3["num_experts_per_tok"],
            v3["moe_intermediate_size"], v3["n_shared_experts"], v3["first_k_dense_replace"],
            v3["n_group"], v3["topk_group"], v3["q_lora_rank"], v3["kv_lora_rank"]) == \
        (61, 7168, 128, 129280, 256, 8, 2048, 1, 3, 8, 4, 1536, 512)
    # the preset planning uses has the same sizes (its attention priced as multi-head)
    preset = get_config("deepseek-v3")
    assert (preset.layers, preset.hidden, preset.heads, preset.vocab, preset.experts,
            preset.top_k, preset.expert_ffn, preset.dense_layers) == \
        (61, 7168, 128, 129280, 256, 8, 2048, 3)
    kimi = json.loads((pub.FOLDER / specs["Kimi K2"].hf_config).read_text())
    assert (kimi["model_type"], kimi["n_routed_experts"], kimi["num_attention_heads"],
            kimi["first_k_dense_replace"]) == ("deepseek_v3", 384, 64, 1)


def test_the_deepseek_row_fixes_what_its_columns_say():
    fix = pub.fix_of(_find("DeepSeek V3 671B", 256))
    assert fix == {"tp": 1, "pp": 4, "cp": 1, "v": 8, "ep": 64, "mb": 1, "zero": 3,
                   "dp_shard": 64, "schedule": "interleaved-1f1b", "recompute": "full"}


@pytest.mark.parametrize("model, gpus, expected", [
    ("Llama3 70B", 64, {"tp": 1, "pp": 1, "cp": 2, "ep": 1, "mb": 1, "zero": 3, "dp_shard": 32,
                        "recompute": "full"}),
    ("Qwen3 MoE 30B", 8, {"tp": 1, "pp": 1, "cp": 1, "ep": 8, "mb": 4, "zero": 3,
                          "dp_shard": 8, "recompute": "full"}),
    ("Kimi K2", 256, {"tp": 1, "pp": 8, "cp": 1, "ep": 32, "mb": 1, "v": 4,
                      "schedule": "interleaved-1f1b", "zero": 3, "dp_shard": 32,
                      "recompute": "full"}),
    ("GPT-OSS 120B", 64, {"tp": 1, "pp": 1, "cp": 1, "ep": 64, "mb": 2, "zero": 3,
                          "dp_shard": 64, "recompute": "none"}),
])
def test_fix_of_rows(model, gpus, expected):
    assert pub.fix_of(_find(model, gpus)) == expected


def test_pipeline_without_virtual_stages_and_plain_data_parallel():
    row = _row(gpus=64, pp=4, vp=1, ep=8, fsdp=None, mbs=4)
    assert pub.fix_of(row) == {"tp": 1, "pp": 4, "cp": 1, "ep": 8, "mb": 4, "v": 1,
                               "schedule": "1f1b", "zero": 1}
    assert pub.fix_of(_row(pp=2, vp=None, fsdp=4))["schedule"] == "1f1b"


def test_what_the_recipes_add_flushes_routing_and_dispatch():
    v3 = [r for r in ROWS if r.model == "DeepSeek V3 671B"]
    # 1024 GPUs: 8 sequences a local batch, 4 of them a step, dp 256: 4 schedule calls
    assert [(r.gpus, r.flushes) for r in v3] == [(1024, 4), (256, 1)]
    assert "4 flushes" in v3[0].configuration() and "recompute=full" in v3[0].configuration()
    assert all(r.routing == "round-robin" and r.runtime == "automodel" for r in v3)
    megatron = next(r for r in ROWS if r.source == "h100-bf16-more.csv")
    assert (megatron.flushes, megatron.routing, megatron.runtime) == \
        (1, "router", "megatron")                 # one schedule over every micro-batch
    hw = pub.run_cluster(v3[0], get_cluster("h100-sxm-dgx"))
    assert hw.round_robin_routing and hw.dispatch_per_rank and hw.fused_pointwise
    assert hw.runtime == "automodel" and hw.tp_overlap == "none"
    hw = pub.run_cluster(megatron, get_cluster("h100-sxm-dgx"))
    assert not hw.dispatch_per_rank and hw.tp_overlap == "pipelined"
    # llm-foundry's rows name its loss: flash-attn's fused cross-entropy; the others do not
    mpt = [r for r in ROWS if r.source.startswith("llmf-")]
    assert mpt and all(r.fused_loss and pub.run_cluster(r, get_cluster("a100-80g-dgx")).fused_loss
                       for r in mpt)
    assert not any(r.fused_loss for r in ROWS if not r.source.startswith("llmf-"))
    # flushes need a pipeline and the local batch the step is made of
    assert _row(gpus=8, pp=2, lbs=2, ga=2).flushes == 2          # 2 x 2 x dp 4 = 16
    assert _row(gpus=8, pp=2, lbs=2, ga=3).flushes == 1          # not the global batch
    assert _row(gpus=8, pp=1, lbs=2, ga=2).flushes == 1


def test_a_step_of_flushes_is_priced_as_that_many_smaller_steps():
    spec = pub.ModelSpec("M", preset="gpt-tiny")
    row = _row(gpus=8, gbs=32, mbs=1, seq=64, pp=2, fsdp=None, lbs=4, ga=2)
    one = pub.price(dataclasses.replace(row, gbs=16, ga=1), spec, "h100-sxm-dgx")
    two = pub.price(row, spec, "h100-sxm-dgx")
    assert row.flushes == 2 and one.priced and two.priced
    assert two.predicted_s == pytest.approx(2 * one.predicted_s)
    assert two.bubble_s == pytest.approx(2 * one.bubble_s) and two.bubble_s > 0


def test_a_model_fxpar_cannot_express_is_listed_with_its_reason():
    nemotron = [r for r in ROWS if r.model.startswith("Nemotron V3")]
    assert nemotron
    specs = pub.load_models()
    for row in nemotron:
        result = pub.price(row, specs[row.model], "h100-sxm-dgx")
        assert not result.priced and result.reason.startswith("not expressible: a hybrid Mamba")


def test_every_fix_is_legal():
    for row in ROWS:
        if not row.missing:
            check_fix(pub.fix_of(row))


def test_what_a_source_does_not_print_is_listed_not_guessed():
    missing = {r.model: r.missing for r in ROWS if r.missing}
    assert missing["Llama-3.1-405B"][:1] == ("mbs",) and "vp" in missing["Llama-3.1-405B"]
    assert "seq" in missing["Llama-2-7B"] and "mbs" in missing["Nemotron-4-15B"]
    row = next(r for r in ROWS if r.model == "Llama-2-7B")
    result = pub.price(row, pub.load_models()[row.model], row.cluster)
    assert not result.priced and result.reason.startswith(
        "under-specified: the source does not print the sequence length (seq)")
    assert "seq=?" in row.configuration()
    assert "| ? |" in report_of.report(pub.Validation("x", (result,), pub.summarize([result]),
                                                      (), ())).replace("  ", " ") or \
        " ? " in report_of.report(pub.Validation("x", (result,), pub.summarize([result]), (),
                                                 ()))


def test_sequence_parallel_rows_fix_the_strategy_they_ran():
    rows = [r for r in ROWS if r.source == "megatron-sp-a100.csv"]
    assert [(r.recompute, r.sp) for r in rows[:2]] == [("full", False), ("selective", True)]
    assert pub.fix_of(rows[1])["strategy"] == "tp+sp+sel"
    assert pub.fix_of(rows[0])["strategy"] == "tp+full"
    with pytest.raises(ValueError, match="sp=1 needs tp > 1"):
        pub.fix_of(_row(sp=True, recompute="full"))


@pytest.mark.parametrize("changes, words", [
    ({"fsdp": 3}, "fsdp=3 does not divide dp"),
    ({"vp": 2}, "vp=2 virtual stages need pp > 1"),
    ({"tp": 3}, "do not split into tp=3"),
])
def test_inconsistent_rows_are_reported_not_priced(changes, words):
    with pytest.raises(ValueError, match=words):
        pub.fix_of(_row(**changes))
    result = pub.price(_row(**changes), None, "h100-sxm-dgx")
    assert not result.priced and words in result.reason and result.error_pct is None


def test_a_row_without_a_model_is_reported_not_priced():
    result = pub.price(_row(model="Nobody 1B"), None, "h100-sxm-dgx")
    assert not result.priced and "no entry for model 'Nobody 1B'" in result.reason


def _priced(step_s: float, predicted_s: float, **row) -> pub.Result:
    return pub.Result(_row(step_s=step_s, **row), (), predicted_s, predicted_s * 0.7,
                      predicted_s * 0.2, predicted_s * 0.1)


def test_error_and_tokens_per_gpu():
    r = _priced(10.0, 12.5)
    assert r.error_pct == pytest.approx(25.0)
    assert r.predicted_tokens_per_s_per_gpu == pytest.approx(16 * 1024 / (12.5 * 8))
    assert pub.error_pct(8.0, 10.0) == pytest.approx(-20.0)


def test_summary_counts_priced_rows_only():
    results = [_priced(10, 11.5), _priced(10, 7.5), _priced(10, 10.5),
               pub.Result(_row(), (), reason="no")]
    s = pub.summarize(results)
    assert (s.rows, s.priced, s.within_10, s.within_20) == (4, 3, 1, 2)
    assert s.median_abs_error_pct == pytest.approx(15.0)
    assert s.max_abs_error_pct == pytest.approx(25.0)
    assert "3 of 4 rows priced: median |error| 15.0%, max |error| 25.0%" in report_of.summary_text(s)
    assert pub.summarize([]).median_abs_error_pct is None


def _ranked(tokens_and_predicted: list[tuple[float, float]], **row) -> tuple[pub.Ranking, list]:
    results = [pub.Result(_row(line=i, tokens_per_s_per_gpu=tokens, **row), (), predicted_s)
               for i, (tokens, predicted_s) in enumerate(tokens_and_predicted)]
    (ranking,) = pub.rankings(results + [_priced(1, 1, model="Alone")])
    return ranking, results


def test_ranking_measured_against_predicted():
    ranking, (a, b, c) = _ranked([(100, 2.0), (90, 1.5), (80, 3.0)])
    assert (ranking.model, ranking.gpus) == ("M", 8)
    assert ranking.measured == (a, b, c) and ranking.predicted == (b, a, c)
    assert ranking.verdict.startswith("the measured fastest is predicted 25.0% slower")
    assert ranking.verdict.endswith("not within 5%")
    text = "\n".join(report_of.ranking_text(ranking))
    assert "measured:  #1 (100) > #2 (90) > #3 (80)" in text
    assert "predicted: #2 (" in text


def test_ranking_within_five_percent_and_ties():
    ranking, _ = _ranked([(100, 2.05), (90, 2.0)])
    assert ranking.verdict.endswith("slower than the predicted fastest: within 5%")
    ranking, _ = _ranked([(100, 2.0), (90, 2.5)])
    assert ranking.verdict == "the measured fastest is predicted fastest"
    ranking, _ = _ranked([(100, 2.0), (90, 2.0)])
    assert ranking.verdict == "the measured fastest is predicted fastest (tied with 1 other row)"
    assert "predicted: #1 (1,024) = #2 (1,024)" in "\n".join(report_of.ranking_text(ranking))


def test_ranking_lists_rows_not_priced():
    results = [_priced(10, 9), pub.Result(_row(line=3), (), reason="PlanningError: x")]
    (ranking,) = pub.rankings(results)
    assert ranking.unpriced == (results[1],)
    assert ranking.verdict == "fewer than two rows priced: no ranking"
    assert "#2 not priced" in "\n".join(report_of.ranking_text(ranking))
    unpriced = [pub.Result(_row(line=n), (), reason="PlanningError: x") for n in (3, 4)]
    (ranking,) = pub.rankings(unpriced)    # no row of the group priced: still reported
    assert "#1 not priced" in "\n".join(report_of.ranking_text(ranking))


def test_report_lists_every_row_and_why_one_is_not_priced():
    results = (_priced(10, 11), pub.Result(_row(model="X"), (), reason="no entry for model 'X'"))
    v = pub.Validation("h100-sxm-dgx", results, pub.summarize(results), (), (("M", "a note"),))
    text = report_of.report(v)
    assert "not priced: t:9 X on 8 GPUs" in text and "no entry for model 'X'" in text
    assert "+10.0" in text and "M: a note" in text
    data = report_of.to_json(v)
    assert data["rows"][1]["reason"] and data["rows"][0]["error_pct"] == pytest.approx(10.0)


def test_select_by_model_substring():
    assert {r.model for r in pub.select(ROWS, "deepseek")} == {"DeepSeek V3 671B"}
    with pytest.raises(ValueError, match="no published run's model contains 'nope'; models:"):
        pub.select(ROWS, "nope")


HEADER = ",".join(pub.COLUMNS)
GOOD = "M,8,16,2,2,1,1024,1,1,1,-,-,8,k,1.5,-,100"


@pytest.mark.parametrize("text, words", [
    (f"# c\nmodel,gpus\n{GOOD}\n", "missing columns gbs"),
    (f"{HEADER}\n{GOOD.replace('M,8', 'M,-')}\n",
     "line 2: gpus must be a positive integer, got '-'"),
    (f"# c\n{HEADER}\n{GOOD},7\n", "line 3: 18 fields, the header has 17"),
    (f"{HEADER}\n{GOOD.replace(',1.5,', ',fast,')}\n", "step_s must be a positive number"),
    ("# only a comment\n", "no header line and no rows"),
    (f"{HEADER},recompute\n{GOOD},most\n", "recompute must be one of -, none, selective, full"),
    (f"# routing: fair\n{HEADER}\n{GOOD}\n", "'# routing: fair' is not one of router"),
])
def test_bad_csv_is_one_line_naming_file_and_line(tmp_path, text, words):
    path = tmp_path / "runs.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=words) as err:
        pub.read_rows(path)
    assert "runs.csv" in str(err.value) and "\n" not in str(err.value)


def test_models_json_errors(tmp_path):
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": {"A": {"preset": "x", "hf_config": "y"}}}))
    with pytest.raises(ValueError, match="give one of"):
        pub.load_models(path)
    path.write_text(json.dumps({"models": {"A": {"preset": "x", "overrides": {"wings": 2}}}}))
    with pytest.raises(ValueError, match="unknown keys"):
        pub.load_models(path)


@pytest.mark.parametrize("argv, words", [
    (["validate", "--match", "nope"], "no published run's model contains 'nope'"),
    (["validate", "--csv", "/nonexistent/runs.csv"], "cannot read /nonexistent/runs.csv"),
    (["validate", "--cluster", "tpu-pod"], "unknown cluster 'tpu-pod'"),
])
def test_validate_bad_inputs_are_one_line(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fxpar: error:") and words in err


def test_validate_a_csv_of_unknown_models_reports_them(tmp_path, capsys):
    path = tmp_path / "runs.csv"
    path.write_text(f"# Source: none\n{HEADER}\n{GOOD.replace('M,', 'Unknown 1B,', 1)}\n")
    assert main(["validate", "--csv", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"][0]["reason"].startswith("no entry for model 'Unknown 1B'")
    assert data["summary"]["priced"] == 0


def test_package_data_ships_every_published_file():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["planner.bench"]
    folder = pub.FOLDER.parent
    shipped = {p for pattern in patterns for p in folder.glob(pattern)}
    assert set(pub.FOLDER.rglob("*.*")) <= shipped


def test_validate_cross_validates_from_the_command_line(tmp_path, capsys):
    """Two sources under Megatron-LM's runtime, one row and three: the one left out is priced
    with the family fitted on the other's three rows, the three with the priors (one row is
    fewer than the fit's MIN_ROWS), and the report says so per row, per source and overall."""
    rows = (pub.FOLDER / "megatron-sp-a100.csv").read_text().splitlines()
    head = [line for line in rows if line.startswith("#") and "runtime:" in line or
            line.startswith("# cluster:")]
    table = [line for line in rows if not line.startswith("#")]
    paths = []
    for name, chosen in (("a.csv", table[1:2]), ("b.csv", table[2:5])):
        paths += ["--csv", str(tmp_path / name)]
        (tmp_path / name).write_text("# Source: a test\n" + "\n".join(head + [table[0], *chosen])
                                     + "\n")
    assert main(["validate", *paths, "--cross-validate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fit of the megatron family on its 4 priced rows")
    assert "a: 1 rows" in out and "b: 3 rows" in out and "overall: 4 rows" in out
    # GPT 22B's two runs and GPT-3's: the selective run of each measured faster
    assert "rankings left out: in 2 of 2 groups" in out
    assert main(["validate", *paths, "--cross-validate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f["source"] for f in data["cross_validation"]] == ["a.csv", "b.csv"]
    assert [[f["family"] for f in fold["fits"]] for fold in data["cross_validation"]] == \
        [["megatron"], []]
    assert main(["validate", *paths, "--fit", "--cluster", "a100-80g-dgx"]) == 2
    assert "drop --cluster" in capsys.readouterr().err
