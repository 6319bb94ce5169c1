"""Flags that conflict, or that the chosen mode would ignore, are one-line errors (exit status 2)
naming them and what to do; settings no plan can have name the legal values."""
import json

import pytest

from planner.cli import main

PLAN = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--cluster", "cpu-gloo"]


def _error(capsys, argv) -> str:
    """Run argv: exit status 2 and one line on stderr, no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refuses before the command runs
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("argv, words", [
    (["plan", "--hf", "llama", "--model", "gpt-tiny", "--gpus", "2"],
     ["--model and --hf each name the model", "give one of --model PRESET"]),
    (["plan", "--hf-config", "x.json", "--model", "llama2-7b", "--gpus", "2"],
     ["--model and --hf-config each name the model"]),
    (["plan", "--hf", "llama", "--hf-config", "x.json", "--gpus", "2"],
     ["--hf and --hf-config each name the model"]),
    (["simulate", "--hf", "llama", "--model", "gpt-tiny", "--gpus", "2"],
     ["--model and --hf each name the model"]),
])
def test_two_model_flags_are_refused(capsys, argv, words):
    err = _error(capsys, argv)
    assert all(w in err for w in words), err


@pytest.mark.parametrize("argv, words", [
    (["plan", "--diff", "a.json", "b.json", "--model", "gpt-tiny"],
     ["--model does not apply to --diff", "compares the two saved plans", "drop --model"]),
    (["plan", "--diff", "a.json", "b.json", "--gpus", "8", "--json"],
     ["--gpus, --json do not apply to --diff"]),
    (PLAN + ["--emit", "megatron", "--emit-csv", "x.csv"],
     ["--emit-csv", "--emit megatron writes none", "drop --emit-csv"]),
    (PLAN + ["--emit-csv", "y.csv"], ["--emit-csv", "add --emit torchtitan or drop --emit-csv"]),
    (PLAN + ["--top-k", "3"], ["--top-k sets how many alternatives --explain prints",
                               "add --explain or drop --top-k"]),
    (PLAN + ["--check-every-rank", "--emit", "megatron"],
     ["--check-every-rank does not apply to --emit", "run --check-every-rank without --emit"]),
    (PLAN + ["--check", "--from-torchtitan", "job.toml"],
     ["--check does not apply to --from-torchtitan"]),
    (PLAN + ["--explain", "--emit", "torchtitan"],
     ["--explain does not apply to --emit", "--explain goes with fxpar's plan or --from-*"]),
    (PLAN + ["--moe-imbalance", "1.2", "--emit", "megatron"],
     ["--moe-imbalance", "has no mixture-of-experts layer: leave it out"]),
    (PLAN + ["--json", "--explain", "--check"],
     ["--explain, --check do not apply to --json", "run --explain, --check without --json"]),
    (["simulate", "--plan", "p.json", "--model", "gpt-tiny", "--gpus", "8"],
     ["--model, --gpus do not apply to --plan", "drop --plan to plan anew"]),
    (["run", "--weights", "ckpt", "--gpus", "2", "--runtime", "megatron", "--zero1"],
     ["--runtime, --zero1 do not apply to --weights", "drop --runtime, --zero1"]),
    (["run", "--gpus", "2", "--checkpoint", "ckpt"],
     ["--checkpoint DIR alone neither saves nor resumes", "--save-every N", "--resume"]),
    (["bench", "--gpus", "2", "--cluster", "cpu-gloo", "--memory", "--rounds", "2", "--png",
      "x.png"], ["--rounds, --png do not apply to --memory", "drop --rounds, --png"]),
    (["bench", "--gpus", "2", "--warmup", "-1"], ["--warmup", "expected a whole number"]),
])
def test_flags_the_mode_would_ignore_are_refused(capsys, argv, words):
    err = _error(capsys, argv)
    assert all(w in err for w in words), err


def test_plan_json_with_png_writes_both(capsys, tmp_path):
    png = tmp_path / "plan.png"
    assert main(PLAN + ["--json", "--png", str(png)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["mesh"] and png.exists()
    assert f"plan picture written to {png}" in out.err


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "8", "--fix", "dp_shard=3"],
     ["dp_shard=3 must divide dp", "no dp × tp × pp × cp mesh of the 8 GPUs",
      "nearest legal dp_shard: 2 or 4"]),
    # dp=3 would take it, but the global batch 8 rules dp=3 out
    (["--gpus", "12", "--global-batch", "8", "--fix", "dp_shard=3"],
     ["dp_shard=3 does not divide dp=", "nearest legal dp_shard: 2 or 4"]),
])
def test_dp_shard_that_divides_no_dp_names_the_nearest_legal(capsys, argv, words):
    err = _error(capsys, ["plan", "--model", "gpt-tiny", "--cluster", "cpu-gloo", *argv])
    assert all(w in err for w in words) and "infeasible" not in err, err


def test_moe_imbalance_of_a_dense_model_is_refused(capsys):
    err = _error(capsys, PLAN + ["--moe-imbalance", "1.2"])
    assert "the model has no mixture-of-experts layer: leave it out" in err


def test_encoder_only_hf_config_is_refused_naming_the_supported_kinds(capsys, tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "bert.json"
    config.write_text(json.dumps({"model_type": "bert", "hidden_size": 256, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "intermediate_size": 512}))
    err = _error(capsys, ["plan", "--hf-config", str(config), "--gpus", "2", "--cluster",
                          "cpu-gloo"])
    assert "model_type 'bert' is an encoder-only masked language model" in err
    assert all(kind in err for kind in ("decoder-only", "encoder-decoder", "vision-language"))
