"""`fxpar train CONFIG.toml`: the configuration, its sections and keys, each checked with a
one-line error that names the key and the values it allows, and command-line overrides in
torchtitan's form (`--training.steps 100`, `--optimizer.lr=3e-4`).

    [model]         what to train: a preset (with size overrides), a Hugging Face checkpoint
                    directory, or a Hugging Face config.json
    [data]          the token files `fxpar data prepare` wrote
    [optimizer]     AdamW (default) or SGD, weight decay and what it leaves out
    [lr_schedule]   warm-up, then cosine, linear or constant decay to min_lr
    [training]      steps, global batch, sequence length, precision, clipping, seed
    [parallel]      the plan (auto: the planner chooses; or a --fix string), the cluster, and
                    the launch: ranks per node, restarts
    [checkpoint]    DCP checkpoints: where, how often, resume, Hugging Face export
    [logging]       the run folder, how often a line is printed, progress bar, TensorBoard, plot
    [eval]          validation loss every N steps over M batches

`SCHEMA` is the reference: docs/training.md's table lists the same keys (tests/unit/
test_train_config.py checks that it does). `load(path, overrides)` returns a TrainConfig whose
sections read as attributes: `config.training.steps`.
"""
from __future__ import annotations

import difflib
import math
import os
import tomllib
from dataclasses import dataclass
from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration or override that cannot be used; the message is one line naming the key."""


@dataclass(frozen=True)
class Key:
    """One configuration key: its default, what it allows (said in the error) and the check."""

    default: Any
    allows: str
    check: Callable[[Any], Any]   # returns the value to keep (converted) or raises ValueError
    doc: str = ""


# -- checks: each returns the value or raises ValueError (the caller names the key) -------------
def _int(low: int = 1) -> Callable:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError
        return v
    return check


def _number(low: float = 0.0, strict: bool = False, high: float = math.inf) -> Callable:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError
        if v < low or (strict and v == low) or v >= high:
            raise ValueError
        return float(v)
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError
    return v


def _choice(*choices) -> Callable:
    def check(v):
        if not isinstance(v, str) or v not in choices:
            raise ValueError
        return v
    return check


def _auto_or(check: Callable) -> Callable:
    def either(v):
        return v if v == "auto" else check(v)
    return either


def _text(v):
    if not isinstance(v, str) or not v.strip():
        raise ValueError
    return v


def _optional_text(v):
    if not isinstance(v, str):
        raise ValueError
    return v


def _betas(v):
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                       for b in v)):
        raise ValueError
    return (float(v[0]), float(v[1]))


def _nnodes(v):
    text = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
    if not isinstance(text, str):
        raise ValueError
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError
    if len(parts) == 2 and int(parts[0]) > int(parts[1]):
        raise ValueError
    return text


def parse_fix(text: str) -> dict:
    """'tp=2,pp=2,mb=1' -> {'tp': 2, 'pp': 2, 'mb': 1}, as `fxpar plan --fix` reads it."""
    from planner.search.meshes import parse_fix as parse
    return parse(text)


def _plan(v):
    if not isinstance(v, str):
        raise ValueError
    if v.strip() == "auto":
        return "auto"
    try:
        parse_fix(v)
    except ValueError as err:
        raise ValueError(str(err)) from None
    return v.strip()


SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "preset": Key("", "a preset name: " + "gpt-tiny, llama-tiny, gpt2-small, llama2-7b, ... "
                      "(fxpar plan --help)", _optional_text,
                      "a reference preset (planner.models.presets), initialised per shard"),
        "hf_dir": Key("", "a folder written by save_pretrained (config.json + safetensors)",
                      _optional_text, "a Hugging Face checkpoint directory: its weights"),
        "hf_config": Key("", "a Hugging Face config.json (or a folder holding one)",
                         _optional_text, "a Hugging Face architecture from its config, "
                         "initialised per shard"),
        "layers": Key(0, "a positive integer (0: the preset's)", _int(0), "preset override"),
        "hidden": Key(0, "a positive integer (0: the preset's)", _int(0), "preset override"),
        "heads": Key(0, "a positive integer (0: the preset's)", _int(0), "preset override"),
        "kv_heads": Key(0, "a positive integer (0: the preset's)", _int(0), "preset override"),
        "ffn": Key(0, "a positive integer (0: the preset's)", _int(0), "preset override"),
        "vocab": Key(0, "a positive integer (0: the preset's)", _int(0), "preset override"),
        "tie": Key("auto", "true, false or \"auto\" (the preset's)", _auto_or(_bool),
                   "head shares the embedding's weight (preset override)"),
        "dropout": Key(-1.0, "a number in [0, 1) (-1: the preset's)",
                       lambda v: v if v == -1 else _number(0.0, high=1.0)(v),
                       "preset override"),
    },
    "data": {
        "path": Key("", "a folder written by `fxpar data prepare` (header.json, train.bin, "
                    "val.bin)", _text, "the prepared token files"),
        "verify": Key(True, "true or false", _bool,
                      "check each split's checksum and largest token id before the ranks "
                      "start (false: sizes only)"),
    },
    "optimizer": {
        "name": Key("adamw", "\"adamw\" or \"sgd\"", _choice("adamw", "sgd"), ""),
        "lr": Key(3e-4, "a positive number", _number(0.0, strict=True), "peak learning rate"),
        "betas": Key([0.9, 0.95], "two numbers in [0, 1), e.g. [0.9, 0.95]", _betas, "AdamW"),
        "eps": Key(1e-8, "a positive number", _number(0.0, strict=True), "AdamW"),
        "weight_decay": Key(0.1, "a number >= 0", _number(0.0), "decoupled (AdamW)"),
        "momentum": Key(0.9, "a number in [0, 1)", _number(0.0, high=1.0), "SGD"),
        "decay_norms": Key(False, "true or false", _bool, "weight decay on norm weights too"),
        "decay_biases": Key(False, "true or false", _bool, "weight decay on biases too"),
        "decay_embeddings": Key(False, "true or false", _bool,
                                "weight decay on token and position embeddings too"),
    },
    "lr_schedule": {
        "warmup_steps": Key(0, "an integer >= 0", _int(0), "linear warm-up from 0 to lr"),
        "decay": Key("cosine", "\"cosine\", \"linear\" or \"constant\"",
                     _choice("cosine", "linear", "constant"), "after the warm-up"),
        "decay_steps": Key(0, "an integer >= 0 (0: until training.steps)", _int(0),
                           "steps of decay after the warm-up"),
        "min_lr": Key(0.0, "a number >= 0", _number(0.0), "the learning rate decay ends at"),
    },
    "training": {
        "steps": Key(100, "a positive integer", _int(1), "optimizer steps in all"),
        "global_batch": Key(16, "a positive integer", _int(1), "sequences per step"),
        "seq": Key(0, "a positive integer (0: the model's)", _int(0), "tokens per sequence"),
        "precision": Key("auto", "\"auto\" (bf16-main on GPUs, fp32 on CPUs), \"fp32\", "
                         "\"bf16-main\", \"bf16\" or \"fp16\"",
                         _choice("auto", "fp32", "bf16-main", "bf16", "fp16"),
                         "bf16-main: bf16 weights, gradients and activations, fp32 main weights "
                         "in the optimizer (what plans price); bf16/fp16: autocast over fp32 "
                         "weights and optimizer"),
        "clip_grad_norm": Key(1.0, "a number >= 0 (0: no clipping)", _number(0.0),
                              "clip the global gradient norm to this"),
        "seed": Key(0, "an integer >= 0", _int(0), "initial weights and the batch of each step"),
    },
    "parallel": {
        "plan": Key("auto", "\"auto\" or a --fix string such as \"tp=2,pp=2\"", _plan,
                    "auto: the planner chooses for the devices of the launch"),
        "cluster": Key("auto", "\"auto\" (cpu-gloo on CPUs, a100-80g-dgx on GPUs), a cluster "
                       "preset or a profile JSON", _text, "what the planner prices"),
        "memory_limit": Key(0.0, "GiB per device, a number >= 0 (0: the cluster's)",
                            _number(0.0), ""),
        "nproc_per_node": Key("auto", "\"auto\" (the GPUs here, else 1) or a positive integer",
                              _auto_or(_int(1)), "ranks fxpar train starts on this machine"),
        "max_restarts": Key(0, "an integer >= 0", _int(0),
                            "restarts from the latest checkpoint after a rank dies"),
        "timeout_s": Key(0.0, "a number of seconds >= 0 (0: 120 on gloo, 600 on NCCL)",
                         _number(0.0), "how long a collective waits for a peer"),
    },
    "checkpoint": {
        "dir": Key("", "a folder (\"\": <logging.dir>/checkpoints)", _optional_text, ""),
        "every": Key(0, "an integer >= 0 (0: only at the end)", _int(0), "steps between saves"),
        "resume": Key("auto", "\"auto\" (the latest complete checkpoint in dir, if any), "
                      "\"never\", or a checkpoint folder", _text, ""),
        "keep": Key(0, "an integer >= 0 (0: keep all)", _int(0), "the latest checkpoints kept"),
        "export": Key("auto", "\"auto\" (Hugging Face models), true or false",
                      _auto_or(_bool), "a safetensors file under Hugging Face names at the end"),
    },
    "logging": {
        "dir": Key("fxpar-run", "a folder", _text,
                   "metrics.jsonl, loss.png, tensorboard/, checkpoints/ go here"),
        "every": Key(10, "a positive integer", _int(1), "steps between log lines"),
        "progress": Key("auto", "\"auto\" (a bar on a terminal), true or false",
                        _auto_or(_bool), ""),
        "tensorboard": Key("auto", "\"auto\" (when installed), true or false", _auto_or(_bool),
                           ""),
        "plot": Key(True, "true or false", _bool, "loss.png at the end (matplotlib)"),
    },
    "eval": {
        "every": Key(0, "an integer >= 0 (0: no evaluation during training)", _int(0),
                     "steps between validation losses"),
        "steps": Key(10, "a positive integer", _int(1), "validation batches per evaluation"),
        "at_end": Key(True, "true or false", _bool, "one more evaluation after the last step"),
    },
}

# Flags of `fxpar train` that are keys of the config (torchrun's spelling).
FLAG_ALIASES = {"--nproc-per-node": "parallel.nproc_per_node",
                "--max-restarts": "parallel.max_restarts"}


class Section:
    """A section's values as attributes (read-only)."""

    def __init__(self, name: str, values: dict):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, key):
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"[{self._name}] has no key {key!r}") from None

    def __setattr__(self, key, value):
        raise AttributeError("a configuration is read-only; use TrainConfig.with_()")

    def as_dict(self) -> dict:
        return dict(self._values)


class TrainConfig:
    """Every section with every key filled in (defaults, then the file, then overrides)."""

    def __init__(self, values: dict[str, dict], source: str = ""):
        self.source = source
        self._values = {s: dict(v) for s, v in values.items()}
        for name in SCHEMA:
            setattr(self, name, Section(name, self._values[name]))

    def as_dict(self) -> dict[str, dict]:
        return {s: dict(v) for s, v in self._values.items()}

    def with_(self, **dotted) -> "TrainConfig":
        """A copy with `section__key=value` changes (checked)."""
        values = self.as_dict()
        for name, value in dotted.items():
            section, _, key = name.partition("__")
            values[section][key] = _checked(section, key, value, f"[{section}] {key}")
        return TrainConfig(values, self.source)

    # derived values --------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.logging.dir, "checkpoints")

    @property
    def clip(self) -> float | None:
        return self.training.clip_grad_norm or None

    @property
    def fix(self) -> dict:
        return {} if self.parallel.plan == "auto" else parse_fix(self.parallel.plan)

    def timeout_s(self, cuda: bool) -> float:
        return self.parallel.timeout_s or (600.0 if cuda else 120.0)

    def precision(self, cuda: bool) -> str:
        p = self.training.precision
        return ("bf16-main" if cuda else "fp32") if p == "auto" else p


def _known(names, what: str) -> str:
    return f"known {what}: {', '.join(names)}"


def _unknown(kind: str, name: str, names) -> ConfigError:
    close = difflib.get_close_matches(name, list(names), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown {kind} {name}{hint} ({_known(names, kind + 's')})")


def _checked(section: str, key: str, value, where: str):
    if section not in SCHEMA:
        raise _unknown("section", f"[{section}]", [f"[{s}]" for s in SCHEMA])
    if key not in SCHEMA[section]:
        raise _unknown("key", f"{section}.{key}", [f"{section}.{k}" for k in SCHEMA[section]])
    spec = SCHEMA[section][key]
    try:
        return spec.check(value)
    except ValueError as err:
        detail = f": {err}" if str(err) else ""
        raise ConfigError(f"{where}: expected {spec.allows}, got {value!r}{detail}") from None


def _default(key: Key):
    try:
        return key.check(key.default)
    except ValueError:  # a key that must be given ([data] path)
        return key.default


def defaults() -> dict[str, dict]:
    return {s: {k: _default(v) for k, v in keys.items()} for s, keys in SCHEMA.items()}


def parse_value(text: str):
    """A command-line value read as TOML (100, 3e-4, true, [0.9, 0.95], "x"), else as text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(argv: list[str]) -> list[tuple[str, str, Any]]:
    """['--training.steps', '100', '--optimizer.lr=3e-4', '--nproc-per-node', '4'] ->
    [('training', 'steps', 100), ...]; a ConfigError for anything else."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides are --section.key VALUE "
                              f"(e.g. --training.steps 100)")
        name, eq, value = arg[2:].partition("=")
        if f"--{name}" in FLAG_ALIASES:
            name = FLAG_ALIASES[f"--{name}"]
        if "." not in name:
            raise ConfigError(f"unknown option --{name}: overrides are --section.key VALUE "
                              f"(e.g. --training.steps 100); options: "
                              f"{', '.join(FLAG_ALIASES)}")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            value = argv[i + 1]
            i += 1
        section, _, key = name.partition(".")
        out.append((section, key, parse_value(value)))
        i += 1
    return out


def read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not valid TOML: not UTF-8 text") from None


def from_dict(data: dict, source: str = "", overrides: list[str] | None = None) -> TrainConfig:
    """Check a parsed TOML document (and the overrides) key by key and fill in the defaults."""
    values = defaults()
    where = f"{source} " if source else ""
    for section, keys in data.items():
        if section not in SCHEMA:
            raise _unknown("section", f"[{section}]", [f"[{s}]" for s in SCHEMA])
        if not isinstance(keys, dict):
            raise ConfigError(f"{where}{section} must be a section [{section}], got a value "
                              f"{keys!r}")
        for key, value in keys.items():
            if isinstance(value, dict):
                raise ConfigError(f"{where}[{section}] {key}: sections do not nest "
                                  f"([{section}.{key}]); {_known(SCHEMA[section], 'keys')}")
            values[section][key] = _checked(section, key, value, f"{where}[{section}] {key}")
    for section, key, value in parse_overrides(overrides or []):
        values[section][key] = _checked(section, key, value, f"--{section}.{key}")
    config = TrainConfig(values, source)
    check_together(config)
    return config


def load(path: str, overrides: list[str] | None = None) -> TrainConfig:
    return from_dict(read_toml(path), path, overrides)


def check_together(config: TrainConfig) -> None:
    """What keys say together: one model source, a data folder, a sane schedule."""
    m = config.model
    given = [k for k in ("preset", "hf_dir", "hf_config") if getattr(m, k)]
    if len(given) != 1:
        raise ConfigError(f"[model] needs exactly one of preset, hf_dir, hf_config; got "
                          f"{', '.join(given) or 'none'}")
    if not m.preset:
        sizes = [k for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
                 if getattr(m, k)] + (["tie"] if m.tie != "auto" else []) + \
            (["dropout"] if m.dropout != -1 else [])
        if sizes:
            raise ConfigError(f"[model] {', '.join(sizes)} override a preset's sizes; a Hugging "
                              f"Face model takes them from its config.json")
    else:
        from planner.models.dit import DIT_PRESETS
        from planner.models.presets import PRESETS
        if m.preset in DIT_PRESETS:
            raise ConfigError(f"[model] preset {m.preset!r} is a diffusion transformer: fxpar "
                              f"train trains language models on token files; train it with "
                              f"`fxpar run --model {m.preset}` or autoparallelize")
        if m.preset not in PRESETS:
            raise _unknown("preset", repr(m.preset), sorted(PRESETS))
    if not config.data.path:
        raise ConfigError("[data] path: expected a folder written by `fxpar data prepare`, "
                          "got nothing")
    s, t = config.lr_schedule, config.training
    if s.warmup_steps > t.steps:
        raise ConfigError(f"[lr_schedule] warmup_steps {s.warmup_steps} exceeds "
                          f"[training] steps {t.steps}")
    if s.min_lr > config.optimizer.lr:
        raise ConfigError(f"[lr_schedule] min_lr {s.min_lr} exceeds [optimizer] lr "
                          f"{config.optimizer.lr}")
    if config.checkpoint.resume not in ("auto", "never") and \
            not os.path.isdir(config.checkpoint.resume):
        raise ConfigError(f"[checkpoint] resume: expected \"auto\", \"never\" or a checkpoint "
                          f"folder, got {config.checkpoint.resume!r} (no such folder)")
    if config.logging.tensorboard is True:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("[logging] tensorboard = true, but TensorBoard is not installed "
                              "(pip install tensorboard), or set it to \"auto\"") from None
