"""Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE, DeepSeek, GPT-OSS) with their
experts as one `torch.ops.fxpar.routed_experts` op (runtime.experts.custom_op), so that
passes.rewrite.expert_parallel can cut them after torch.export.

transformers 5 holds a family's experts stacked in a `*Experts` module called as
experts(hidden [T, h], top_k_index, top_k_weights); its own router (softmax or sigmoid, top-k,
normalisation, DeepSeek's group-limited choice) stays as it is. `use_routed_experts` swaps each
such module's forward for the op, which computes the same sum (`tests/unit/test_hf_moe.py` and
`tests/unit/test_hf_gpt_oss_experts.py` check it against transformers' own forward) for the two
forms the op knows:

  swiglu   gate_up_proj [E, 2f, h] (gate rows, then up rows), down_proj [E, h, f],
           act_fn(gate) * up with a SiLU act_fn (Mixtral, Qwen3-MoE, DeepSeek)
  gpt_oss  transformers' GptOssExperts: gate_up_proj [E, h, 2f] with gate and up interleaved,
           down_proj [E, f, h], biases gate_up_proj_bias [E, 2f] and down_proj_bias [E, h],
           its own clamped gate (swiglu_alpha, swiglu_limit)

The form is read from the flags transformers' `use_experts_implementation` sets on the module
(is_transposed, is_concatenated, has_bias, has_gate, has_post_expert_norm) and from its gating
function; any other experts module is refused with a ValueError, never computed as another.

The op also carries the router's group limit (DeepSeek-V3's n_group groups, topk_group of them
per token), which the experts module cannot know: the router beside it in the MoE block holds it
(transformers' group-limited routers keep `num_group` and `topk_group`), and cost_model.ops.moe
prices the dispatch with it.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch

from runtime.experts.custom_op import routed_experts

# transformers' use_experts_implementation flags, with the values of the swiglu form (also its
# defaults, which an undecorated experts module is taken to have), and what a differing one means.
_FLAGS = {"is_transposed": (False, "transposed weights (is_transposed: gate_up_proj "
                                   "[experts, hidden, 2*ffn])"),
          "is_concatenated": (True, "interleaved gate and up (is_concatenated=False)"),
          "has_bias": (False, "biases (has_bias)"),
          "has_gate": (True, "no gate projection (has_gate=False)"),
          "has_post_expert_norm": (False, "a norm after each expert (has_post_expert_norm)")}
_GPT_OSS_FLAGS = {"is_transposed": True, "is_concatenated": False, "has_bias": True,
                  "has_gate": True, "has_post_expert_norm": False}
# What a refusal says routed_experts computes, and the families whose experts are of that form
_COMPUTED = ("SwiGLU experts called as experts(hidden, top_k_index, top_k_weights) with "
             "gate_up_proj [experts, 2*ffn, hidden] (gate rows, then up) and down_proj "
             "[experts, hidden, ffn], or GPT-OSS's")
_FAMILIES = "mixtral, qwen3_moe, deepseek_v3, gpt_oss"
# The config field that plans a family without its experts, where one does (Llama 4 has dense
# layers of its own: those moe_layers leaves out)
_DENSE = {"llama4_text": '"moe_layers": [] in its (text) config, every layer dense'}


def _advice(family: str | None) -> str:
    """What makes a refused experts module plannable: its family without experts, where a
    config field does that, else a family whose experts routed_experts computes."""
    dense = _DENSE.get(family)
    return (f"plan it with {dense}, or a family whose experts it computes ({_FAMILIES})"
            if dense else f"plan a family whose experts it computes ({_FAMILIES})")


def _forward(self, hidden_states, top_k_index, top_k_weights):
    groups, topk_groups = getattr(self, "fxpar_group_limit", (1, 1))
    return routed_experts(hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index,
                          self.gate_up_proj, self.down_proj, 1, "moe", self.num_experts,
                          groups=groups, topk_groups=topk_groups)


def _forward_gpt_oss(self, hidden_states, router_indices, routing_weights):
    return routed_experts(hidden_states, routing_weights.to(hidden_states.dtype), router_indices,
                          self.gate_up_proj, self.down_proj, 1, "moe", self.num_experts,
                          self.gate_up_proj_bias, self.down_proj_bias, "gpt_oss",
                          float(self.alpha), float(self.limit))


def _is_experts(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj")


def has_experts(model: torch.nn.Module) -> bool:
    return any(_is_experts(m) for m in model.modules())


def _gate_function(module):
    """The module's gating function (transformers' `_apply_gate`), or None without one."""
    return getattr(type(module), "_apply_gate", None)


def _is_gpt_oss_gate(gate) -> bool:
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return False
    return gate is GptOssExperts._apply_gate


def _is_default_gate(gate) -> bool:
    # transformers' act_fn(gate) * up over the [gate; up] halves; a module without a gating
    # function (undecorated) is read as computing the same
    if gate is None:
        return True
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return gate is _default_apply_gate


def _kind(module, family: str | None = None) -> str:
    """"swiglu" or "gpt_oss", the form of routed_experts that computes this experts module; a
    ValueError naming what the op does not compute otherwise (`family`: the model_type of the
    model holding it, for the advice)."""
    name = type(module).__name__
    flags = {k: bool(getattr(module, k, default)) for k, (default, _) in _FLAGS.items()}
    gate = _gate_function(module)
    if flags == _GPT_OSS_FLAGS and _is_gpt_oss_gate(gate):
        return "gpt_oss"
    odd = [] if _takes_routing(module) else [
        "a forward of the hidden states alone (as Llama 4's: every expert on every token, the "
        "router's scores applied before)"]
    odd += [what for k, (default, what) in _FLAGS.items() if flags[k] != default]
    if not _is_default_gate(gate):
        odd.append(f"its own gating function {getattr(gate, '__qualname__', gate)}")
    act = getattr(module, "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        odd.append(f"activation {type(act).__name__}")
    if odd:
        raise ValueError(f"{name} has {'; '.join(odd)}; routed_experts computes {_COMPUTED}: "
                         f"{_advice(family)}")
    return "swiglu"


def _takes_routing(module) -> bool:
    """Whether the module's forward takes the router's choice beside the hidden states, as
    routed_experts does (hidden, top_k_index, top_k_weights); an undefined forward (*input)
    is taken to."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    return any(p.kind is p.VAR_POSITIONAL for p in params) or len(params) >= 3


def _check_shapes(module, kind: str, family: str | None = None) -> None:
    """The weights lie as `kind` says (an undecorated module could hold another layout)."""
    gate_up, down = module.gate_up_proj.shape, module.down_proj.shape
    e = gate_up[0]
    if kind == "gpt_oss":
        h, f = gate_up[1], down[1]
        want = {"gate_up_proj": (e, h, 2 * f), "down_proj": (e, f, h),
                "gate_up_proj_bias": (e, 2 * f), "down_proj_bias": (e, h)}
    else:
        f, h = down[2], down[1]
        want = {"gate_up_proj": (e, 2 * f, h), "down_proj": (e, h, f)}
    for attr, shape in want.items():
        got = tuple(getattr(module, attr).shape)
        if got != tuple(shape):
            layout = ("[experts, hidden, 2*ffn], transposed" if kind == "swiglu"
                      and len(got) == 3 and got[1:] == tuple(shape)[:0:-1] else "another layout")
            raise ValueError(f"{type(module).__name__}: {attr} is {list(got)} ({layout}), not "
                             f"the {kind} layout's {list(shape)}; routed_experts computes "
                             f"{_COMPUTED}: {_advice(family)}")


def group_limit(block: torch.nn.Module, experts: int) -> tuple[int, int]:
    """(groups, groups per token) of the router among `block`'s children (the MoE block holding
    an experts module of `experts` experts): transformers' group-limited routers (DeepSeek-V2 and
    V3, GLM-4-MoE, ...) hold config.n_group as `num_group` and config.topk_group as `topk_group`.
    (1, 1), no limit, for any other router, for one that keeps every group, and for DeepSeek-V2's
    "greedy" topk_method, which ignores the groups."""
    for router in block.children():
        groups, top = getattr(router, "num_group", None), getattr(router, "topk_group", None)
        if not (isinstance(groups, int) and isinstance(top, int)):
            continue
        if getattr(router, "topk_method", None) == "greedy" or not 1 <= top < groups:
            return 1, 1
        if experts % groups:
            raise ValueError(f"{type(router).__name__}: {groups} expert groups (n_group) do "
                             f"not divide the {experts} experts: set the config's n_group to a "
                             f"divisor of {experts}, or topk_group to n_group (no limit)")
        return groups, top
    return 1, 1


def use_routed_experts(model: torch.nn.Module) -> int:
    """Swap every Hugging Face experts module's forward for routed_experts; returns how many.
    Raises ValueError on an experts module of another form (before swapping any)."""
    family = _family(model)
    found = [(m, _kind(m, family)) for m in model.modules() if _is_experts(m)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no Hugging Face experts module "
                         f"(gate_up_proj / down_proj) to run as routed experts: give it a "
                         f"mixture-of-experts model (has_experts tells)")
    parents = {id(child): m for m in model.modules() for child in m.children()}
    limits = []
    for module, kind in found:
        _check_shapes(module, kind, family)
        block = parents.get(id(module))
        limits.append((1, 1) if block is None else
                      group_limit(block, int(module.gate_up_proj.shape[0])))
    for (module, kind), limit in zip(found, limits):
        forward = _forward_gpt_oss if kind == "gpt_oss" else _forward
        module.fxpar_group_limit = limit   # read by _forward, passed to the op
        module.forward = types.MethodType(forward, module)
    return len(found)


def _family(model: torch.nn.Module) -> str | None:
    """The model_type of the language model in `model` (a vision-language model's text part),
    None where no module carries a transformers config."""
    config = next((m.config for m in model.modules() if hasattr(m, "config")
                   and hasattr(m.config, "get_text_config")), None)
    return None if config is None else getattr(config.get_text_config(), "model_type", None)


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
