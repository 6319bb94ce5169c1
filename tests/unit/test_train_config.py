"""`fxpar train`'s configuration (planner.training.config): every key checked with a one-line
error naming the key and what it allows, unknown sections and keys refused, torchtitan-style
overrides, and docs/training.md's reference listing every key."""
import pathlib

import pytest

from planner.training.config import (SCHEMA, ConfigError, from_dict, parse_overrides,
                                     parse_value)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = {"model": {"preset": "llama-tiny"}, "data": {"path": "data/x"}}


def config(**sections):
    data = {k: dict(v) for k, v in BASE.items()}
    for name, keys in sections.items():
        data.setdefault(name, {}).update(keys)
    return from_dict(data, "run.toml")


def error(data=None, overrides=None, **sections) -> str:
    with pytest.raises(ConfigError) as info:
        if data is not None:
            from_dict(data, "run.toml", overrides)
        else:
            from_dict({**BASE, **sections}, "run.toml", overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_fill_every_key():
    c = config()
    assert c.training.steps == 100 and c.optimizer.name == "adamw"
    assert c.parallel.plan == "auto" and c.fix == {}
    assert c.checkpoint_dir == "fxpar-run/checkpoints"
    assert c.optimizer.betas == (0.9, 0.95)
    assert c.precision(cuda=True) == "bf16-main" and c.precision(cuda=False) == "fp32"
    assert c.clip == 1.0 and config(training={"clip_grad_norm": 0}).clip is None


@pytest.mark.parametrize("section,key,value,allows", [
    ("training", "steps", -3, "a positive integer"),
    ("training", "steps", 2.5, "a positive integer"),
    ("training", "steps", True, "a positive integer"),
    ("training", "precision", "fp8",
     '"auto" (bf16-main on GPUs, fp32 on CPUs), "fp32", "bf16-main", "bf16" or "fp16"'),
    ("optimizer", "name", "lion", '"adamw" or "sgd"'),
    ("optimizer", "lr", 0, "a positive number"),
    ("optimizer", "betas", [0.9], "two numbers in [0, 1), e.g. [0.9, 0.95]"),
    ("lr_schedule", "decay", "step", '"cosine", "linear" or "constant"'),
    ("eval", "steps", 0, "a positive integer"),
    ("logging", "progress", "sometimes", '"auto" (a bar on a terminal), true or false'),
    ("parallel", "nproc_per_node", 0, '"auto" (the GPUs here, else 1) or a positive integer'),
])
def test_a_bad_value_names_the_key_and_what_it_allows(section, key, value, allows):
    message = error(**{section: {key: value}})
    assert message.startswith(f"run.toml [{section}] {key}: expected {allows}, got {value!r}")


def test_a_bad_plan_names_the_item():
    message = error(parallel={"plan": "tp=2,pq=2"})
    assert "[parallel] plan" in message and "unknown key 'pq'" in message
    assert "known keys: dp, tp, pp" in message
    c = config(parallel={"plan": "tp=2, pp=2,mb=1"})
    assert c.fix == {"tp": 2, "pp": 2, "mb": 1}


def test_unknown_sections_and_keys_are_refused_with_a_suggestion():
    assert error(data={**BASE, "trainng": {"steps": 3}}).startswith(
        "unknown section [trainng]; did you mean [training]?")
    message = error(training={"stpes": 3})
    assert message.startswith("unknown key training.stpes; did you mean training.steps?")
    assert "known keys: training.steps, training.global_batch" in message
    assert "sections do not nest" in error(training={"steps": {"a": 1}})


def test_the_model_needs_exactly_one_source():
    assert "exactly one of preset, hf_dir, hf_config; got none" in error(
        data={"data": {"path": "x"}})
    assert "got preset, hf_dir" in error(model={"preset": "llama-tiny", "hf_dir": "d"})
    assert "unknown preset 'lama-tiny'; did you mean llama-tiny?" in error(
        model={"preset": "lama-tiny"})
    assert "override a preset's sizes" in error(model={"hf_config": "c.json", "layers": 2})


def test_keys_that_contradict_each_other():
    assert "warmup_steps 200 exceeds [training] steps 100" in error(
        lr_schedule={"warmup_steps": 200})
    assert "min_lr 0.1 exceeds [optimizer] lr" in error(lr_schedule={"min_lr": 0.1})
    assert "no such folder" in error(checkpoint={"resume": "/no/such/ckpt"})


def test_overrides_in_torchtitan_form():
    assert parse_overrides(["--training.steps", "100", "--optimizer.lr=3e-4",
                            "--optimizer.betas", "[0.8, 0.9]", "--logging.dir", "out/x",
                            "--nproc-per-node", "4", "--max-restarts=2"]) == [
        ("training", "steps", 100), ("optimizer", "lr", 3e-4),
        ("optimizer", "betas", [0.8, 0.9]), ("logging", "dir", "out/x"),
        ("parallel", "nproc_per_node", 4), ("parallel", "max_restarts", 2)]
    assert parse_value("true") is True and parse_value("tp=2,pp=2") == "tp=2,pp=2"
    c = from_dict(BASE, "run.toml", ["--training.steps", "7", "--parallel.plan", "dp=2"])
    assert c.training.steps == 7 and c.fix == {"dp": 2}


@pytest.mark.parametrize("argv,start", [
    (["--training.steps", "x"], "--training.steps: expected a positive integer, got 'x'"),
    (["--training.stepz", "3"], "unknown key training.stepz; did you mean training.steps?"),
    (["--steps", "3"], "unknown option --steps: overrides are --section.key VALUE"),
    (["--training.steps"], "--training.steps needs a value"),
    (["steps=3"], "unexpected argument 'steps=3'"),
])
def test_bad_overrides_are_one_line(argv, start):
    assert error(data=BASE, overrides=argv).startswith(start)


def test_a_copy_with_changes_is_checked():
    c = config()
    assert c.with_(training__steps=5).training.steps == 5 and c.training.steps == 100
    with pytest.raises(ConfigError, match=r"\[training\] steps: expected a positive integer"):
        c.with_(training__steps=0)
    with pytest.raises(AttributeError):
        c.training.steps = 3


def test_the_toml_file_errors(tmp_path):
    from planner.training.config import load
    with pytest.raises(ConfigError, match="does not exist"):
        load(str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml is not valid TOML"):
        load(str(bad))
    good = tmp_path / "good.toml"
    good.write_text('[model]\npreset = "gpt-tiny"\n[data]\npath = "d"\n[training]\nsteps = 9\n')
    assert load(str(good), ["--training.seed", "3"]).training.seed == 3


def _shown(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, tuple):
        return "[" + ", ".join(map(str, v)) + "]"
    return repr(v)


def test_docs_list_every_key_with_its_default_and_values():
    """docs/training.md's config reference has one row per key: | `key` | `default` | allowed |
    what |, as SCHEMA says."""
    from planner.training.config import defaults
    text = (ROOT / "docs" / "training.md").read_text()
    values = defaults()
    for section, keys in SCHEMA.items():
        assert f"**[{section}]**" in text, section
        for name, key in keys.items():
            row = (f"| `{name}` | `{_shown(values[section][name])}` | "
                   f"{key.allows.replace('|', chr(92) + '|')} | {key.doc} |")
            assert row in text, f"docs/training.md lacks the row of [{section}] {name}: {row}"
