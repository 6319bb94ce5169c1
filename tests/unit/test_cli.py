"""The fxpar command line: output forms and one-line errors."""
import json
import subprocess
import sys

import pytest

from planner.cli import main


def test_plan_json_holds_mesh_batching_stages_and_prediction(capsys):
    assert main(["plan", "--model", "gpt2-small", "--gpus", "8", "--cluster", "a100-80g-dgx",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"]["dp"] * data["mesh"]["tp"] * data["mesh"]["pp"] == 8
    assert data["micro_batch"] * data["num_microbatches"] * data["mesh"]["dp"] == data["global_batch"]
    assert len(data["stages"]) == data["mesh"]["pp"]
    for key in ("iteration_s", "peak_memory_bytes", "bubble_fraction", "tflops_per_gpu",
                "tokens_per_s"):
        assert key in data["predicted"]


def test_plan_table(capsys):
    assert main(["plan", "--model", "llama-tiny", "--gpus", "4", "--cluster", "cpu-gloo"]) == 0
    out = capsys.readouterr().out
    assert "fxpar plan: llama-tiny on 4 GPUs" in out and "planned in" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "gpt-5", "--gpus", "8"], "unknown model preset 'gpt-5'"),
    (["plan", "--model", "gpt-tiny", "--gpus", "8", "--cluster", "tpu-pod"], "tpu-pod"),
    (["plan", "--model", "gpt-tiny", "--gpus", "8", "--cluster", "/nonexistent/p.json"],
     "/nonexistent/p.json"),
    (["plan", "--model", "gpt-tiny", "--gpus", "2", "--autocast", "bf16", "--emit", "megatron"],
     "leave --autocast out"),
    (["run", "--model", "gpt-tiny", "--gpus", "2", "--autocast", "bf16"],
     "--autocast is for fxpar plan"),
])
def test_bad_values_give_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxpar: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("argv", [["plan", "--gpus", "0"], ["plan", "--gpus", "eight"],
                                  ["plan", "--gpus", "8", "--fix", "tp=two"], ["nope"]])
def test_bad_flags_exit_2_without_traceback(argv):
    proc = subprocess.run([sys.executable, "-m", "planner.cli", *argv], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr


@pytest.mark.parametrize("command", ["plan", "run"])
def test_help(command):
    proc = subprocess.run([sys.executable, "-m", "planner.cli", command, "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "examples:" in proc.stdout


def test_plan_hugging_face_config_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 64, "n_head": 4,
                                  "vocab_size": 128, "n_positions": 16}))
    assert main(["plan", "--hf-config", str(config), "--gpus", "2", "--cluster", "cpu-gloo",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "GPT2LMHeadModel"
    assert sum(len(s["layers"]) for s in data["stages"]) == 3 + 2


@pytest.mark.parametrize("argv, message", [
    (["plan", "--hf", "bert", "--gpus", "2"], "'bert' is an encoder-only masked language model"),
    (["plan", "--hf", "lama", "--gpus", "2"], "unknown Hugging Face architecture 'lama'"),
    (["plan", "--hf-config", "/nonexistent/config.json", "--gpus", "2"], "/nonexistent/config.json"),
    (["plan", "--diff", "/nonexistent/a.json", "/nonexistent/b.json"], "cannot read plan file"),
])
def test_unreadable_inputs_give_one_line_errors(capsys, argv, message):
    if "--hf" in argv:
        pytest.importorskip("transformers")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxpar: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("command", ["simulate", "bench", "calibrate"])
def test_help_of_every_subcommand(command):
    proc = subprocess.run([sys.executable, "-m", "planner.cli", command, "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: fxpar" in proc.stdout


def test_plan_explain_diff_and_simulate(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    args = ["--model", "gpt2-small", "--gpus", "16", "--cluster", "a100-80g-dgx"]
    assert main(["plan", *args, "--json"]) == 0
    a.write_text(capsys.readouterr().out)
    assert main(["plan", *args, "--fix", "tp=2,pp=2,strategy=tp,schedule=1f1b", "--json"]) == 0
    b.write_text(capsys.readouterr().out)
    assert main(["plan", "--diff", str(a), str(b)]) == 0
    assert "configuration" in capsys.readouterr().out
    assert main(["plan", *args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "top " in out and "binding constraint of the winner" in out
    assert main(["simulate", "--plan", str(b), "--out", str(tmp_path / "tl")]) == 0
    assert (tmp_path / "tl" / "timeline.png").exists()
    assert json.loads((tmp_path / "tl" / "timeline.json").read_text())


def test_fix_context_parallel(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--gpus", "8", "--cluster", "cpu-gloo",
                 "--fix", "cp=2,pp=2,dp=2,mb=2", "--json"]) == 0
    mesh = json.loads(capsys.readouterr().out)["mesh"]
    assert mesh == {"dp": 2, "tp": 1, "pp": 2, "cp": 2}


def _one_line_error(capsys, argv, status: int = 2) -> str:
    """Run argv; it must fail with `status` and one short line on stderr, no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refuses before the command runs
        code = exit_.code
    assert code == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 700, err
    return err.strip()


@pytest.mark.parametrize("fix, words", [
    ("zz=1", ["unknown key 'zz'", "dp, tp, pp, cp, mb, v, schedule, strategy, recompute"]),
    ("tp=two", ["'tp=two'", "tp must be a positive integer"]),
    ("tp=2.5", ["'tp=2.5'", "tp must be a positive integer"]),
    ("pp=0", ["'pp=0'", "pp must be a positive integer"]),
    ("dp=-2", ["'dp=-2'", "dp must be a positive integer"]),
    ("mb=", ["'mb='", "mb must be a positive integer"]),
    ("schedule=pipedream", ["unknown schedule 'pipedream'", "1f1b, gpipe, interleaved-1f1b, zb-h1"]),
    ("strategy=fast", ["bad strategy 'fast'", "tp, sp and one of sel/full"]),
    ("recompute=most", ["recompute must be one of none, selective, full"]),
    ("v=2,schedule=1f1b", ["v=2", "schedule=interleaved-1f1b", "one stage per rank"]),
    ("tp=2,tp=4", ["tp is given twice"]),
])
def test_bad_fix_items_are_one_line_naming_the_key_and_the_legal_values(capsys, fix, words):
    err = _one_line_error(capsys, ["plan", "--model", "gpt-tiny", "--gpus", "8", "--fix", fix])
    assert "error:" in err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "13"], ["13 GPUs: no factorisation", "nearest GPU counts that plan: 12 or 14"]),
    (["--gpus", "8", "--layers", "5", "--fix", "pp=8"],
     ["pp=8 exceeds the 7 layers", "nearest legal pp: 4"]),
    (["--gpus", "3", "--global-batch", "8", "--fix", "dp=3"],
     ["global batch 8 is not divisible by dp=3", "nearest legal dp: 1"]),
    (["--gpus", "8", "--memory-limit", "0.001"],
     ["no plan fits in 0.0010 GiB", "needs is 0.00", "raise the memory limit (GiB)"]),
])
def test_plan_refusals_name_the_filter_and_the_nearest_legal_value(capsys, argv, words):
    err = _one_line_error(capsys, ["plan", "--model", "gpt-tiny", "--cluster", "cpu-gloo", *argv])
    assert err.startswith("fxpar: error:")
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("content, words", [
    ("[1, 2]", ["is not a plan", "expected a JSON object, got list"]),
    ('"a plan"', ["is not a plan", "expected a JSON object, got str"]),
    ("{not json", ["is not a plan", "not JSON", "line 1 column 2"]),
    ('{"model": "gpt-tiny"}', ["is not a plan", "missing 'cluster'", "more"]),
    (b"\xff\xfe\x00", ["is not a plan", "not UTF-8 text"]),
])
def test_diff_of_files_that_are_not_plans_is_one_line(tmp_path, capsys, content, words):
    bad = tmp_path / "bad.json"
    (bad.write_bytes if isinstance(content, bytes) else bad.write_text)(content)
    err = _one_line_error(capsys, ["plan", "--diff", str(bad), str(bad)])
    for word in [str(bad), *words]:
        assert word in err, err
    assert "cannot read plan file" in _one_line_error(capsys, ["plan", "--diff", str(tmp_path),
                                                               str(bad)])


@pytest.mark.parametrize("config, words", [
    ([1], ["expected a JSON object, got list"]),
    ("{", ["is not JSON"]),
    ({"n_layer": 2}, ['no "model_type"']),
    ({"model_type": "nosuch"}, ["knows no model_type 'nosuch'"]),
    ({"model_type": "lama"}, ["knows no model_type 'lama'", "did you mean llama"]),
    ({"model_type": "vit"}, ["'vit' has no causal language model"]),
    ({"model_type": "gpt2", "n_layer": "two"}, ["transformers rejects the config", "n_layer"]),
    ({"model_type": "gpt2", "n_embd": 63, "n_head": 4}, ["divisible by num_heads"]),
])
def test_hugging_face_configs_transformers_cannot_use_are_one_line(tmp_path, capsys, config,
                                                                    words):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    err = _one_line_error(capsys, ["plan", "--hf-config", str(path), "--gpus", "2", "--cluster",
                                   "cpu-gloo"])
    for word in [str(path), *words]:
        assert word in err, err


def test_plan_json_is_the_same_for_the_same_request_but_for_timing(capsys):
    argv = ["plan", "--model", "gpt2-small", "--gpus", "16", "--cluster", "a100-80g-dgx", "--json"]
    outs = []
    for _ in range(2):
        assert main(argv) == 0
        outs.append(capsys.readouterr().out)
    first, second = (json.loads(out) for out in outs)
    assert set(first.pop("timing")) == {"solve_s", "search_s"}
    second.pop("timing")
    assert first == second
    assert outs[0].split('"timing"')[0] == outs[1].split('"timing"')[0]
    assert list(json.loads(outs[0]))[-1] == "timing"


def test_run_trains_the_global_batch_it_planned_for(monkeypatch, tmp_path, capsys):
    import planner.training.local
    seen = {}
    monkeypatch.setattr(planner.training.local, "compare_with_reference",
                        lambda config, plan, steps: seen.update(config=config, plan=plan))
    assert main(["run", "--model", "gpt-tiny", "--gpus", "2", "--global-batch", "8",
                 "--steps", "1"]) == 0
    assert seen["plan"].global_batch == 8 and seen["config"].global_batch == 8
    assert main(["run", "--model", "gpt-tiny", "--gpus", "2", "--global-batch", "4",
                 "--torchrun", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "model.json").read_text())["global_batch"] == 4
    assert json.loads((tmp_path / "plan.json").read_text())["global_batch"] == 4
    capsys.readouterr()
    refused = _one_line_error(capsys, ["run", "--hf", "gpt2", "--gpus", "2"])
    assert "fxpar run trains presets" in refused, refused
