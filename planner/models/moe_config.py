"""Checks and derived sizes of a mixture-of-experts ModelConfig (no model code, so that
planner.models.presets can check its presets without importing the model classes)."""
from __future__ import annotations

from runtime.experts.dispatch import check_groups


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
    check_groups(cfg.experts, cfg.top_k, cfg.expert_groups, cfg.topk_groups)


def expert_width(cfg) -> int:
    return cfg.expert_ffn or cfg.ffn_hidden


def preset_runs(cfg) -> tuple[int, tuple[tuple[int, int], ...] | None]:
    """(blocks to capture, runs for planner.search.costs.ModelCosts) of a preset: one block of each
    kind. A dense model or one of MoE blocks only: one block, runs=None (every block alike);
    dense first blocks: a dense and a MoE block, runs ((0, dense), (1, the rest))."""
    if not getattr(cfg, "experts", 0) or not cfg.dense_layers:
        return 1, None
    return 2, ((0, cfg.dense_layers), (1, cfg.layers - cfg.dense_layers))


def captured_config(cfg):
    """The config preset_runs captures: its first `kinds` blocks, one dense where it has any."""
    kinds, _ = preset_runs(cfg)
    if getattr(cfg, "experts", 0):  # (a DiT's config has no experts)
        return cfg.with_(layers=kinds, dense_layers=min(cfg.dense_layers, 1))
    return cfg.with_(layers=kinds)
