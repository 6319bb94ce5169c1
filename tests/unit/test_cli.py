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
