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
    (["plan", "--hf", "bert", "--gpus", "2"], "unknown Hugging Face architecture 'bert'"),
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
