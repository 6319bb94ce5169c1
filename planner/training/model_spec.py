"""[model] of a `fxpar train` config as what the planner and the ranks need: the model built on
the meta device (each rank gives values to its own shard only), what to plan (a preset's
config, captured one block at a time, or the meta module), its vocabulary and sequence length,
and where its weights come from (a Hugging Face checkpoint directory, or the per-parameter
init rule seeded by [training] seed)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSpec:
    kind: str                  # "preset", "hf_dir" or "hf_config"
    name: str
    vocab: int
    seq: int                   # [training] seq, or the model's own
    preset: object = None      # planner.models.presets.ModelConfig of a preset
    path: str = ""             # the Hugging Face folder or config.json

    @property
    def weights(self) -> str | None:
        return self.path if self.kind == "hf_dir" else None

    @property
    def is_hf(self) -> bool:
        return self.kind != "preset"

    def meta_model(self) -> torch.nn.Module:
        if self.kind == "preset":
            from planner.models.presets import build_model
            return build_model(self.preset, device="meta")
        from planner.models.hf import build_hf_from_file
        from planner.models.hf_moe import has_experts, use_routed_experts
        with torch.device("meta"):
            model = build_hf_from_file(_config_file(self.path))
        if has_experts(model):  # one routed_experts op per layer, as fxpar plan does
            use_routed_experts(model)
        return model

    def plan_target(self, model: torch.nn.Module | None = None):
        """What planner.api.plan is given: a preset's config (one block captured and counted),
        or the meta module itself."""
        return self.preset if self.kind == "preset" else (model or self.meta_model())


def parameter_count(model: torch.nn.Module) -> str:
    """'10.5 M parameters' (tied weights once), of a model on any device."""
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e9:.2f} B parameters" if n >= 1e9 else f"{n / 1e6:.1f} M parameters"


def _config_file(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _hf_sizes(path: str) -> tuple[int, int | None]:
    """(vocab, maximum positions) from a Hugging Face config.json, without building the model."""
    file = _config_file(path)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise ValueError(f"[model] {path}: cannot read {file}: "
                         f"{(err.strerror or str(err)).lower()}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"[model] {file} is not JSON: {err}") from None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(f"[model] {file} has no vocab_size")
    return vocab, text.get("n_positions") or text.get("max_position_embeddings")


def model_spec(config) -> ModelSpec:
    """The ModelSpec of a planner.training.config.TrainConfig (a one-line ValueError for a model
    that cannot be had)."""
    m, t = config.model, config.training
    if m.preset:
        from planner.models.presets import get_config
        sizes = {k: getattr(m, k) or None for k in ("layers", "hidden", "heads", "kv_heads",
                                                    "ffn", "vocab")}
        if m.tie != "auto":
            sizes["tie"] = m.tie
        if m.dropout != -1:
            sizes["dropout"] = m.dropout
        cfg = get_config(m.preset, seq=t.seq or None, global_batch=t.global_batch, **sizes)
        return ModelSpec("preset", m.preset, cfg.vocab, cfg.seq, preset=cfg)
    if m.hf_dir:
        if not os.path.isdir(m.hf_dir) or not os.path.exists(os.path.join(m.hf_dir,
                                                                          "config.json")):
            raise ValueError(f"[model] hf_dir {m.hf_dir}: expected a folder written by "
                             f"save_pretrained (config.json and safetensors)")
        path, kind = m.hf_dir, "hf_dir"
    else:
        path, kind = m.hf_config, "hf_config"
        if not os.path.exists(_config_file(path)):
            raise ValueError(f"[model] hf_config {path}: no such file")
    vocab, positions = _hf_sizes(path)
    seq = t.seq or positions
    if not seq:
        raise ValueError(f"[model] {path}: the config gives no maximum positions; set "
                         f"[training] seq")
    if positions and seq > positions:
        raise ValueError(f"[training] seq {seq} exceeds the model's {positions} positions")
    name = os.path.basename(os.path.normpath(path))
    return ModelSpec(kind, name, vocab, int(seq), path=path)


def example_batch(spec: ModelSpec, global_batch: int, device="cpu"):
    """(tokens, targets) of the plan's shape: what the ranks capture and check against."""
    tokens = torch.zeros(global_batch, spec.seq, dtype=torch.long, device=device)
    return tokens, tokens.clone()
