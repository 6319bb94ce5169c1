"""Checks and derived sizes of a mixture-of-experts ModelConfig (no model code, so that
planner.models can check its presets without importing the model classes)."""
from __future__ import annotations


def check_moe(cfg) -> None:
    """One-line errors for MoE sizes that cannot build."""
    if cfg.arch != "llama":
        raise ValueError(f"mixture of experts is built on the llama arch, got {cfg.arch!r}")
    if isinstance(cfg.experts, bool) or not isinstance(cfg.experts, int) or cfg.experts < 1:
        raise ValueError(f"experts must be a positive integer, got {cfg.experts!r}")
    if not isinstance(cfg.top_k, int) or not 1 <= cfg.top_k <= cfg.experts:
        raise ValueError(f"top_k must be between 1 and experts={cfg.experts}, got {cfg.top_k!r}")
    if not isinstance(cfg.dense_layers, int) or not 0 <= cfg.dense_layers < cfg.layers:
        raise ValueError(f"dense_layers must be in [0, layers={cfg.layers}), got "
                         f"{cfg.dense_layers!r}")
    if cfg.router not in ("softmax", "sigmoid"):
        raise ValueError(f"router must be 'softmax' or 'sigmoid', got {cfg.router!r}")
    if cfg.shared_experts < 0 or cfg.aux_loss < 0 or not cfg.route_scale > 0:
        raise ValueError("shared_experts and aux_loss must be >= 0 and route_scale > 0")


def expert_width(cfg) -> int:
    return cfg.expert_ffn or cfg.ffn_hidden
