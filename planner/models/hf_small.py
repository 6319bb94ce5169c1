"""The small sizes fxpar builds Hugging Face models at, applied where each config keeps them.

A config holds its sizes at the top (Llama: hidden_size, num_hidden_layers, ...) or in
sub-configs (Emu3: text_config beside vq_config; BLT: patcher, encoder, decoder and global
configs; Git: vision_config beside its own decoder sizes). `fields` makes one config class's
constructor arguments at the small sizes; `parts` does so for every sub-config of a config, so
that no part of a family is built at its published size while the others are small;
`config_fields` puts both together with the caller's overrides.
"""
from __future__ import annotations

import inspect

from planner.models.hf_wrapper import transformers_module

# Small sizes that train on CPU ranks, by transformers' standard config names (each config's
# `attribute_map` translates them: n_layer for GPT-2, ...); any field can be overridden.
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=256,
             max_position_embeddings=32)
# Fields some configs have, shrunk with the sizes above when the config's constructor takes them
# (values from the sizes); an override wins.
DERIVED = {
    "intermediate_size": lambda s: 2 * s["hidden_size"],
    "ffn_dim": lambda s: 2 * s["hidden_size"],
    "head_dim": lambda s: s["hidden_size"] // s["num_attention_heads"],
    "num_key_value_heads": lambda s: max(1, s["num_attention_heads"] // 2),
    "rotary_dim": lambda s: s["hidden_size"] // s["num_attention_heads"] // 2,
    # multi-head latent attention (DeepSeek): head parts and compressed ranks at the small sizes
    "qk_rope_head_dim": lambda s: s["hidden_size"] // s["num_attention_heads"] // 2,
    "qk_nope_head_dim": lambda s: s["hidden_size"] // s["num_attention_heads"] // 2,
    "v_head_dim": lambda s: s["hidden_size"] // s["num_attention_heads"],
    "kv_lora_rank": lambda s: s["hidden_size"] // 4,
    "q_lora_rank": lambda s: s["hidden_size"] // 2,
    # many small experts (DeepSeek's 256 in 8 groups, top 8) shrunk to 8 in 2 groups, top 2
    "moe_intermediate_size": lambda s: s["hidden_size"],
    "n_routed_experts": lambda s: 8,
    "n_group": lambda s: 2,
    "topk_group": lambda s: 1,
    "first_k_dense_replace": lambda s: 1,   # dense first blocks, then MoE, within 2 layers
    # GPT-Neo's pattern of global and local attention, repeated to the number of layers
    "attention_types": lambda s: [[["global", "local"], s["num_hidden_layers"] // 2]]
    + [[["global"], s["num_hidden_layers"] % 2]],
}
# Tables and widths a few families size apart from the fields above, lowered to these values
# (never raised; a default of 0 or None, a part switched off, stays so): BLT's hashed byte
# n-grams and global width, VQ-VAE codebooks and widths (Emu3, Janus), projector widths (Llama 4's
# vision adapter, Janus), feed-forward widths by other names (CTRL, CPM-Ant, LongCat), Phi-4's
# audio encoder (its blocks are its layers).
CAPPED = {
    "encoder_hash_byte_group_vocab": lambda s: s["vocab_size"],
    "hidden_size_global": lambda s: s["hidden_size"],   # BLT's global width, seen by its parts
    "codebook_size": lambda s: s["vocab_size"],
    "num_embeddings": lambda s: s["vocab_size"],
    "base_channels": lambda s: 32,       # a multiple of the VQ-VAEs' 32 GroupNorm groups
    "latent_channels": lambda s: s["hidden_size"],
    "num_res_blocks": lambda s: 1,
    "projection_dim": lambda s: s["hidden_size"],
    "image_token_embed_dim": lambda s: s["hidden_size"],
    "projector_input_dim": lambda s: s["hidden_size"],
    "projector_output_dim": lambda s: s["hidden_size"],
    "vision_output_dim": lambda s: s["hidden_size"],
    "ffn_hidden_size": lambda s: 2 * s["hidden_size"],
    "expert_ffn_hidden_size": lambda s: 2 * s["hidden_size"],
    "dim_ff": lambda s: 2 * s["hidden_size"],
    "dff": lambda s: 2 * s["hidden_size"],
    "mlp_dim": lambda s: 2 * s["hidden_size"],
    "num_blocks": lambda s: s["num_hidden_layers"],
    "ext_pw_out_channel": lambda s: s["hidden_size"],
    "depthwise_separable_out_channel": lambda s: s["hidden_size"],
    "nemo_conv_channels": lambda s: s["hidden_size"],
}
# ... and any field whose name holds one of these: the feed-forward widths of shared experts,
# dense first layers and the like (shared_expert_intermediate_size, intermediate_size_mlp), the
# vocabularies of other parts (unpadded_vocab_size, vocab_size_per_layer_input, a vision
# tower's visual words)
CAPPED_PARTS = (("intermediate_size", lambda s: 2 * s["hidden_size"]),
                ("vocab_size", lambda s: s["vocab_size"]))


def config_fields(cls, overrides: dict) -> dict:
    """The arguments that make config class `cls` at the small sizes, in each of its parts too
    (`parts`), with `overrides`: a size applies to every part, any other field where the config
    keeps it (`route`)."""
    sizes = {**SMALL, **{k: v for k, v in overrides.items() if k in SMALL}}
    kwargs = fields(cls, sizes)
    made = parts(cls(), sizes)
    kwargs["use_cache"] = False  # training: a KV cache would only be built and thrown away
    own = dict(getattr(cls, "attribute_map", {}) or {})
    rest = {k: v for k, v in overrides.items() if k not in SMALL}
    kwargs.update({own.get(k, k): v for k, v in route(cls(), rest, made).items()})
    kwargs.update({own.get(k, k): v for k, v in overrides.items() if k in SMALL})
    return {**made, **kwargs}


def fields(cls, sizes: dict) -> dict:
    """The constructor arguments that make config class `cls` at `sizes` (SMALL's names): the
    sizes by the class's own names, the fields derived from them (DERIVED) or lowered with them
    (CAPPED), dropout off, token ids outside the small vocabulary moved to 0."""
    own = dict(getattr(cls, "attribute_map", {}) or {})
    accepted = set(inspect.signature(cls.__init__).parameters)
    defaults = cls()
    kwargs = {own.get(k, k): v for k, v in sizes.items()}
    kwargs.update({name: rule(sizes) for name, rule in DERIVED.items() if name in accepted})
    kwargs.update({k: v for k, v in capped(cls, sizes).items() if k not in kwargs})
    if "kv_lora_rank" in accepted:  # latent attention expands its keys/values to every head
        kwargs[own.get("num_key_value_heads", "num_key_value_heads")] = sizes["num_attention_heads"]
    if "n_routed_experts" in accepted:
        kwargs["num_experts_per_tok"] = 2
    for name, value in vars(defaults).items():
        if name in accepted and _is_dropout(name, value):
            kwargs[name] = 0.0
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(defaults, name, None)
        if isinstance(value, int) and value >= sizes["vocab_size"]:
            kwargs[name] = 0
    return kwargs


def capped(cls, sizes: dict) -> dict:
    """The fields of config class `cls` that CAPPED or CAPPED_PARTS name, at `sizes` or their
    default where that is lower. A field without a default of its own (None: the config derives
    it from the sizes, as Falcon its ffn_hidden_size) is left to the config."""
    made = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        value = param.default
        rule = CAPPED.get(name) or next((r for part, r in CAPPED_PARTS if part in name), None)
        if rule and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            made[name] = min(rule(sizes), value)
    return made


def parts(defaults, sizes: dict, skip=()) -> dict:
    """Every sub-config of the config `defaults` (text_config, vision_config, vq_config, ...)
    but those named in `skip`, as the dict its parent builds it from: the family's own defaults
    for that part, at `sizes`. Only the fields the part's class declares are given (a vision
    tower has no vocabulary)."""
    specs = getattr(type(defaults), "sub_configs_defaults", None) or {}
    made = {}
    for name, part in vars(defaults).items():
        if name in skip or not _is_config(part):
            continue
        declared = set(inspect.signature(type(part).__init__).parameters) | set(vars(part))
        small = {k: v for k, v in fields(type(part), sizes).items() if k in declared}
        family = getattr(specs.get(name), "init_kwargs", None) or {}
        made[name] = {"model_type": part.model_type, **family, **small}
    return made


def route(defaults, overrides: dict, made: dict) -> dict:
    """`overrides` that are not sizes, each given where the config keeps it: at the top where
    its class declares the field, else to every part (in `made`, from `parts`) that declares it,
    else at the top as transformers keeps any field."""
    top = {}
    declared = set(inspect.signature(type(defaults).__init__).parameters) | set(vars(defaults))
    declared |= set(getattr(type(defaults), "attribute_map", {}) or {})
    for key, value in overrides.items():
        owners = [name for name in made if key not in declared
                  and key in set(vars(getattr(defaults, name)))]
        for name in owners:
            made[name][key] = value
        if not owners:
            top[key] = value
    return top


def _is_config(value) -> bool:
    return isinstance(value, transformers_module().PreTrainedConfig)


def _is_dropout(name: str, value) -> bool:
    return (isinstance(value, float) and not isinstance(value, bool)
            and ("dropout" in name or "pdrop" in name) and value > 0)
