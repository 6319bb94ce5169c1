"""Hugging Face transformers models (the optional `hf` extra), built from a config, no download.

`HFCausalLM` wraps a `*ForCausalLM` so that, like fxpar's reference models, it takes
`(tokens, targets)` and returns the loss; it is captured with `torch.export` (symbolic tracing
cannot follow transformers' control flow) with the KV cache off.
"""
from __future__ import annotations

import difflib
import json

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
    """A model from a config.json (its "model_type" picks the architecture). Whatever is wrong
    with the file is a ValueError of one short line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"cannot read Hugging Face config {path}: "
                         f"{(err.strerror or str(err)).lower()}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not JSON: not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a Hugging Face config: expected a JSON object, got "
                         f"{type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f'{path} has no "model_type" (e.g. "gpt2", "llama"), which picks the '
                         f'architecture')
    tf = _transformers()
    if model_type not in tf.CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(tf.CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"{path}: transformers {tf.__version__} knows no model_type "
                         f"{model_type!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                              " (e.g. gpt2, llama, mistral, qwen2)"))
    try:
        config = tf.AutoConfig.for_model(**data)
    except Exception as err:  # noqa: BLE001 - transformers raises assorted types for bad fields
        raise ValueError(f"{path}: transformers rejects the config: {_one_line(err)}") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{path}: model_type {model_type!r} has no causal language model in "
                         f"transformers (AutoModelForCausalLM); fxpar plans models that take "
                         f"tokens and return the loss")
    try:
        model = tf.AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - as above, while building the modules
        raise ValueError(f"{path}: transformers cannot build the model: {_one_line(err)}") \
            from None
    return HFCausalLM(model)


def _one_line(err: Exception, limit: int = 300) -> str:
    """The error's text as one line, cut at `limit` characters (transformers lists hundreds of
    model types in some of its messages)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sequence_length(model: HFCausalLM) -> int:
    config = model.model.config
    length = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings",
                                                             None)
    if not length:
        raise ValueError("the config has neither n_positions nor max_position_embeddings: give "
                         "the sequence length (--seq)")
    return int(length)


def vocab_size(model: HFCausalLM) -> int:
    return int(model.model.config.vocab_size)
