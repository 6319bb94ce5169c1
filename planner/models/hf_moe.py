"""Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE) with their experts as one
`torch.ops.fxpar.routed_experts` op (runtime.experts.custom_op), so that passes.rewrite.expert_parallel can cut
them after torch.export.

transformers 5 holds a family's experts as stacked `gate_up_proj` [E, 2f, h] and `down_proj`
[E, h, f] in a `*Experts` module called as experts(hidden [T, h], top_k_index, top_k_weights);
its own router (softmax or sigmoid, top-k, normalisation, DeepSeek's group-limited choice) stays
as it is. `use_routed_experts` swaps each such module's forward for the op, which computes the
same sum (`tests/unit/test_hf_moe.py` checks it against transformers' own forward).
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from runtime.experts.custom_op import routed_experts


def _forward(self, hidden_states, top_k_index, top_k_weights):
    return routed_experts(hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index,
                          self.gate_up_proj, self.down_proj, 1, "moe", self.num_experts)


def has_experts(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")
               for m in model.modules())


def use_routed_experts(model: torch.nn.Module) -> int:
    """Swap every Hugging Face experts module's forward for routed_experts; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            if getattr(module, "act_fn", None) is not None and \
                    type(module.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
                raise ValueError(f"{type(module).__name__}: routed_experts computes SwiGLU "
                                 f"experts, got activation {type(module.act_fn).__name__}")
            module.forward = types.MethodType(_forward, module)
            count += 1
    if not count:
        raise ValueError(f"{type(model).__name__} has no Hugging Face experts module "
                         f"(gate_up_proj / down_proj) to run as routed experts")
    return count


@dataclass(frozen=True)
class HFMoESpec:
    """planner.training.local.HFSpec of a MoE family, with its experts as routed_experts."""

    arch: str
    global_batch: int = 8
    overrides: tuple[tuple[str, object], ...] = ()

    def build(self):
        from planner.models.hf import HFSpec
        model, batch = HFSpec(self.arch, self.global_batch, self.overrides).build()
        use_routed_experts(model)
        return model, batch
