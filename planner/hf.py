"""Hugging Face transformers models (the optional `hf` extra), built from a config, no download.

`HFCausalLM` wraps a `*ForCausalLM` so that, like fxpar's reference models, it takes
`(tokens, targets)` and returns the loss; it is captured with `torch.export` (symbolic tracing
cannot follow transformers' control flow) with the KV cache off.
"""
from __future__ import annotations

import json
import os

import torch

ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}
# Small sizes that train on CPU ranks; any field can be overridden.
SMALL = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=8, vocab_size=256, n_positions=32,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                 eos_token_id=0),
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                  max_position_embeddings=32, bos_token_id=0, eos_token_id=0),
}


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError("Hugging Face models need the optional extra: "
                           "pip install 'fxpar[hf]'") from err
    return transformers


class HFCausalLM(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def fxpar_name(self) -> str:
        return type(self.model).__name__

    def forward(self, tokens, targets):
        return self.model(input_ids=tokens, labels=targets, use_cache=False).loss


def build_hf(arch: str, **overrides) -> HFCausalLM:
    """A randomly initialised model of a known architecture at small default sizes."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown Hugging Face architecture {arch!r}; known: "
                         f"{', '.join(sorted(ARCHITECTURES))} (or give --hf-config FILE.json)")
    tf = _transformers()
    config_cls, model_cls = (getattr(tf, name) for name in ARCHITECTURES[arch])
    config = config_cls(**{**SMALL[arch], **overrides})
    config._attn_implementation = "sdpa"
    return HFCausalLM(getattr(tf, model_cls.__name__)(config))


def build_hf_from_file(path: str) -> HFCausalLM:
    """A model from a config.json (its "model_type" picks the architecture)."""
    if not os.path.exists(path):
        raise ValueError(f"cannot read Hugging Face config {path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err}") from err
    tf = _transformers()
    config = tf.AutoConfig.for_model(**data)
    return HFCausalLM(tf.AutoModelForCausalLM.from_config(config))


def sequence_length(model: HFCausalLM) -> int:
    config = model.model.config
    return int(getattr(config, "n_positions", None) or config.max_position_embeddings)


def vocab_size(model: HFCausalLM) -> int:
    return int(model.model.config.vocab_size)
