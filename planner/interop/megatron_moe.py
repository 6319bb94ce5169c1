"""A mixture of experts and multi-latent attention as Megatron-LM's flags state them
(megatron/training/arguments.py: --num-experts and the --moe-* flags; --multi-latent-attention
with its widths), both ways: the model's value of each property (`values`), the flags that state
a value (`flags_for`) and the value flags state (`SPECS`, with Megatron-LM's defaults), read by
planner.interop.megatron_model as its other properties are. A property of a model without
experts (or without latent attention) is None: nothing to state, nothing to check."""
from __future__ import annotations

import re

from planner.interop.model_facts import ModelFacts

NONE = "absent"  # a property the model lacks: a value, unlike None (megatron_model's NONE)


def _run_text(layers: tuple[bool, ...]) -> str:
    """Megatron-LM's --moe-layer-freq list expression, runs folded: '([0]*1+[1]*26)'."""
    runs: list[list] = []
    for moe in layers:
        if runs and runs[-1][0] == moe:
            runs[-1][1] += 1
        else:
            runs.append([moe, 1])
    return "(" + "+".join(f"[{int(v)}]*{n}" for v, n in runs) + ")"


def values(facts: ModelFacts) -> dict:
    """The model's value of each property (None: it has no experts / no latent attention)."""
    e, m = facts.experts, facts.mla
    moe = {"experts": e.count if e else NONE, "top_k": e and e.top_k, "moe_ffn": e and e.ffn,
           "shared_ffn": e and (e.shared_ffn or NONE),
           "moe_layers": e and (_run_text(e.layers) if e.layers else NONE),
           "score": e and e.score, "pre_softmax": e and e.pre_softmax, "scale": e and e.scale,
           "router_groups": e and e.groups, "group_topk": e and e.group_topk,
           "expert_bias": e and e.expert_bias}
    mla = {"mla": m is not None, "kv_lora_rank": m and m.kv_lora_rank,
           "q_lora_rank": m and (m.q_lora_rank or NONE), "qk_head_dim": m and m.qk_head_dim,
           "qk_pos_dim": m and m.qk_pos_dim, "v_head_dim": m and m.v_head_dim}
    return {**moe, **mla}


# property -> (its flag, whether a switch, the default Megatron-LM takes without it)
FLAGS = {
    "experts": ("--num-experts", False, NONE), "top_k": ("--moe-router-topk", False, 2),
    "moe_ffn": ("--moe-ffn-hidden-size", False, None),
    "shared_ffn": ("--moe-shared-expert-intermediate-size", False, NONE),
    "moe_layers": ("--moe-layer-freq", False, NONE),
    "score": ("--moe-router-score-function", False, "softmax"),
    "pre_softmax": ("--moe-router-pre-softmax", True, False),
    "scale": ("--moe-router-topk-scaling-factor", False, 1.0),
    "router_groups": ("--moe-router-num-groups", False, 1),
    "group_topk": ("--moe-router-group-topk", False, 1),
    "expert_bias": ("--moe-router-enable-expert-bias", True, False),
    "mla": ("--multi-latent-attention", True, False),
    "kv_lora_rank": ("--kv-lora-rank", False, 32), "q_lora_rank": ("--q-lora-rank", False, NONE),
    "qk_head_dim": ("--qk-head-dim", False, 128),
    "qk_pos_dim": ("--qk-pos-emb-head-dim", False, 64),
    "v_head_dim": ("--v-head-dim", False, 128),
}
# written even where the value is Megatron-LM's default: what a reader checks first
ALWAYS = ("experts", "top_k", "moe_ffn", "kv_lora_rank", "qk_head_dim", "qk_pos_dim",
          "v_head_dim")
INT_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
             "--moe-shared-expert-intermediate-size", "--moe-router-num-groups",
             "--moe-router-group-topk", "--kv-lora-rank", "--q-lora-rank", "--qk-head-dim",
             "--qk-pos-emb-head-dim", "--v-head-dim")
STR_FLAGS = ("--moe-layer-freq", "--moe-router-score-function",
             "--moe-router-topk-scaling-factor")
SWITCHES = ("--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
            "--multi-latent-attention")


def flags_for(key: str, value) -> list[str]:
    """The flags that state `value` of property `key`."""
    flag, switch, default = FLAGS[key]
    if value is None or value == NONE or (value == default and key not in ALWAYS):
        return []
    if switch:
        return [flag] if value else []
    if key == "moe_layers":
        return [f"{flag} '{value}'"]
    if isinstance(value, float):  # as it reads back: an integral one short, any other repr
        return [f"{flag} {int(value) if value.is_integer() else repr(value)}"]
    return [f"{flag} {value}"]


def _moe_layers_of_flags(f: dict, facts) -> str:
    """--moe-layer-freq as Megatron-LM reads it: N (every N-th layer, from the first) or a
    list expression of 1s and 0s, one per layer; every layer: NONE."""
    text = str(f.get("--moe-layer-freq", 1))
    if text.isdigit():
        layers = tuple(i % int(text) == 0 for i in range(facts.layers))
    else:
        if re.search(r"[^,\d\[\]()+* ]", text):
            raise ValueError(f"--moe-layer-freq {text!r}: expected N or a list expression such "
                             f"as '([0]*1+[1]*26)'")
        try:  # the characters above only: a list expression, as Megatron-LM evaluates it
            layers = tuple(bool(x) for x in eval(text, {"__builtins__": {}}))  # noqa: S307
        except Exception:  # noqa: BLE001 - a malformed expression of the allowed characters
            raise ValueError(f"--moe-layer-freq {text!r} is not a list expression") from None
    return NONE if all(layers) else _run_text(layers)


def _of_flags(key: str):
    flag, switch, default = FLAGS[key]

    def read(f: dict, facts):
        if key == "moe_layers":
            return _moe_layers_of_flags(f, facts)
        if key == "moe_ffn" and flag not in f:  # Megatron-LM's default: --ffn-hidden-size
            return f.get("--ffn-hidden-size", facts.ffn)
        if switch:
            return bool(f.get(flag))
        value = f.get(flag, default)
        if key == "scale":
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{flag}: expected a number, got {value!r}") from None
        return value
    return read


def _has(key: str):
    return lambda stated: stated[key] not in (NONE, False, None)


_SAY = {"experts": lambda v: "none (a dense MLP)" if v == NONE else str(v),
        "shared_ffn": lambda v: "none" if v == NONE else str(v),
        "moe_layers": lambda v: "every layer" if v == NONE else v,
        "pre_softmax": lambda v: "softmax over all experts, then the top-k" if v else
        "the top-k, then their softmax",
        "mla": lambda v: "multi-latent" if v else "multi-head",
        "q_lora_rank": lambda v: "none (queries projected directly)" if v == NONE else str(v),
        "scale": repr}
_WHAT = {"experts": "number of experts", "top_k": "number of experts per token (top-k)",
         "moe_ffn": "expert's MLP width", "shared_ffn": "shared experts' MLP width",
         "moe_layers": "layers with experts", "score": "router's score function",
         "pre_softmax": "routing", "scale": "routed weights' scaling factor",
         "router_groups": "number of expert groups", "group_topk": "expert groups per token",
         "expert_bias": "router's expert bias", "mla": "attention",
         "kv_lora_rank": "key/value latent rank", "q_lora_rank": "query latent rank",
         "qk_head_dim": "query/key head width without positions",
         "qk_pos_dim": "query/key rotary head width", "v_head_dim": "value head width"}
# (key, what, flags, of_flags, say, applies): megatron_model.Item's fields
SPECS = tuple(
    (key, _WHAT[key], (FLAGS[key][0],), _of_flags(key), _SAY.get(key, str),
     (lambda stated: True) if key in ("experts", "mla") else
     _has("mla" if key in ("kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_dim",
                           "v_head_dim") else "experts"))
    for key in FLAGS)

