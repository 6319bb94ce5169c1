"""Hugging Face transformers models (the optional `hf` extra), built from a config, no download.

`HFCausalLM` wraps a `*ForCausalLM` so that, like fxpar's reference models, it takes
`(tokens, targets)` (targets: the next token of each position) and returns the loss; it is
captured with `torch.export` (symbolic tracing cannot follow transformers' control flow) with the
KV cache off. `small_config` / `build_hf` make any decoder-only `model_type` at small sizes
(`architectures()` lists them); planner.models.hf_families lists the families the tests cover.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from planner.models import hf_attention, hf_rope, hf_sinks, hf_small
from planner.models.hf_seq2seq import HFSeq2SeqLM, sequence_length as seq2seq_length
from planner.models.hf_wrapper import HFWrapper, transformers_module as _transformers


class HFCausalLM(HFWrapper):

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        hf_rope.prepare(model)  # longrope's long frequencies as a buffer (see at_length below)

    def forward(self, tokens, targets):
        """The mean cross-entropy of every position against `targets`, the token that follows
        it (as fxpar's own models take them). transformers' `labels=` would shift the labels
        inside the graph, pairing each position with its neighbour, which under context
        parallelism may live on another rank. Rotary frequencies that transformers recomputes
        from the positions (longrope, dynamic NTK) are those of this sequence length, fixed
        (planner.models.hf_rope)."""
        with hf_attention.plain_positions(), hf_rope.at_length(self.model, tokens.shape[-1]):
            logits = self.model(input_ids=tokens, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def architectures() -> list[str]:
    """Every decoder-only model_type of the installed transformers: it has a causal language
    model, and no masked or sequence-to-sequence one (BERT and BART also have causal LM heads)."""
    tf = _transformers()
    other = (tf.MODEL_FOR_MASKED_LM_MAPPING, tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING)
    return sorted(t for t, cls in tf.CONFIG_MAPPING.items()
                  if cls in tf.MODEL_FOR_CAUSAL_LM_MAPPING
                  and not any(cls in mapping for mapping in other))


def is_causal(arch: str) -> bool:
    """Whether `arch` is one of architectures(), importing only its own config's module."""
    tf = _transformers()
    if arch not in tf.CONFIG_MAPPING.keys():
        return False
    cls = tf.CONFIG_MAPPING[arch]
    return cls in tf.MODEL_FOR_CAUSAL_LM_MAPPING and not any(
        cls in m for m in (tf.MODEL_FOR_MASKED_LM_MAPPING, tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING))


def small_config(arch: str, text_part: bool = False, **overrides):
    """`arch`'s config at the small sizes (planner.models.hf_small.SMALL), in each of its parts
    (a text_config, a vision_config, ...) too; dropout off (as an override, any rate); token ids
    outside the small vocabulary moved to 0. An override of a size applies to every part, any
    other to the part that has the field. text_part: `arch` is the text model of a
    vision-language one (qwen2_vl_text), which need not be a causal LM of its own."""
    tf = _transformers()
    if arch not in tf.CONFIG_MAPPING.keys():
        close = difflib.get_close_matches(arch, list(tf.CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"unknown Hugging Face architecture {arch!r}: transformers "
                         f"{tf.__version__} has no model_type of that name"
                         + (f"; did you mean {', '.join(close)}?" if close else "")
                         + " (or give --hf-config FILE.json)")
    if not (text_part or is_causal(arch)):
        raise ValueError(f"Hugging Face architecture {arch!r} {_other_kind(tf, arch)}, which "
                         f"fxpar does not plan; {SUPPORTED_KINDS}")
    return _at_small_sizes(arch, lambda: tf.AutoConfig.for_model(
        arch, **hf_small.config_fields(tf.CONFIG_MAPPING[arch], overrides)))


def _other_kind(tf, arch: str) -> str:
    """What the known model_type `arch` is, when fxpar does not build it (build_hf has taken the
    vision-language and encoder-decoder ones it plans before asking)."""
    cls = tf.CONFIG_MAPPING[arch]
    if cls in tf.MODEL_FOR_MASKED_LM_MAPPING:
        return "is an encoder-only masked language model"
    if cls in tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:  # Chameleon: images as VQ tokens
        return ("is a vision-language model without a vision tower and a text model of their "
                "own (vision_config, text_config)")
    return "has no causal language model in transformers (AutoModelForCausalLM)"


def _at_small_sizes(arch: str, make, *args):
    """`make(*args)`, building `arch`'s config or model; whatever transformers raises there (a
    validator tying fields fxpar does not shrink together, a field its code expects, a default
    config its own validator rejects) becomes one line naming the family."""
    try:
        return make(*args)
    except Exception as err:  # noqa: BLE001 - the family's own code at fxpar's small sizes
        raise _cannot_build(arch, err) from None


def _cannot_build(arch: str, err: Exception) -> ValueError:
    return ValueError(f"{arch}: transformers cannot build it at fxpar's small sizes "
                      f"({_one_line(err, 200)}); plan its config.json with --hf-config")


def from_config(config) -> HFCausalLM:
    """The causal LM of `config`, with PyTorch's fused attention where the architecture has it
    (planner.models.hf_attention: it stays is_causal when captured), fxpar's fused attention with
    sinks where its attention has them (GPT-OSS: planner.models.hf_sinks), its eager attention
    where it has neither (Gemma-2's soft-capped scores, ALiBi in BLOOM and MPT)."""
    tf = _transformers()
    model_cls = tf.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    fused = getattr(model_cls, "_supports_sdpa", False)
    # Architectures that look attention up in transformers' AttentionInterface take ours.
    interface = getattr(model_cls, "_supports_attention_backend", False)
    sinks = interface and getattr(config, "model_type", None) in hf_sinks.MODEL_TYPES
    attention = (hf_sinks.register() if sinks else hf_attention.register() if fused and interface
                 else "sdpa" if fused else "eager")
    return HFCausalLM(tf.AutoModelForCausalLM.from_config(config, attn_implementation=attention))


def build_hf(arch: str, **overrides) -> HFCausalLM:
    """A randomly initialised model of any transformers decoder-only architecture (its
    model_type: gpt2, llama, gemma2, ...) at small default sizes; a vision-language one (llava,
    paligemma, ...: planner.models.hf_vlm) with a small vision tower beside."""
    from planner.models import hf_seq2seq, hf_vlm
    if hf_vlm.is_vision_language_arch(arch):  # gemma3 is also a causal LM: of text and images
        config = _vlm_small_config(arch, **overrides)
        try:
            return _vlm_from_config(config)
        except ValueError:  # fxpar's refusals, one line already
            raise
        except Exception as err:  # noqa: BLE001 - the family's own code at fxpar's small sizes
            raise _cannot_build(arch, err) from None
    if not is_causal(arch) and hf_seq2seq.is_seq2seq_arch(arch):  # t5, bart, ...
        return hf_seq2seq.build_seq2seq(arch, **overrides)
    return _at_small_sizes(arch, from_config, small_config(arch, **overrides))


def extra_batch(names, shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Example model inputs beside the tokens, in the order of `names`: an attention mask that
    pads the first few tokens of some samples (left padding), position ids that restart
    part-way (two sequences packed into each sample)."""
    batch, seq = shape
    made = []
    for name in names:
        if name == "attention_mask":
            mask = torch.ones(shape, dtype=torch.long)
            pads = torch.randint(0, seq // 4, (batch,), generator=gen)
            for row, pad in enumerate(pads.tolist()):
                mask[row, :pad] = 0
            made.append(mask)
        elif name == "position_ids":
            cut = seq // 2 + int(torch.randint(-seq // 4, seq // 4, (), generator=gen))
            row = torch.cat([torch.arange(cut), torch.arange(seq - cut)])
            made.append(row.expand(batch, seq).contiguous())
        else:
            raise ValueError(f"no example of model input {name!r}; known: attention_mask, "
                             f"position_ids")
    return tuple(made)


SUPPORTED_KINDS = ("fxpar plans decoder-only causal LMs (gpt2, llama, ...), encoder-decoder "
                   "models (t5, bart, ...) and vision-language models (llava, qwen2_vl, ...)")


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
    _check_keys(path, data, tf.CONFIG_MAPPING[model_type])
    try:
        config = tf.AutoConfig.for_model(**data)
    except Exception as err:  # noqa: BLE001 - transformers raises assorted types for bad fields
        raise ValueError(f"{path}: transformers rejects the config ({_one_line(err)}): "
                         f"correct the field it names") from None
    from planner.models import hf_vlm
    if hf_vlm.is_vision_language(config):
        return _built(path, _vlm_from_config, config)
    from planner.models import hf_seq2seq
    if hf_seq2seq.is_seq2seq(config):  # before the causal LM: BART has a decoder-only one too
        return _built(path, hf_seq2seq.from_config, config)
    if type(config) in tf.MODEL_FOR_MASKED_LM_MAPPING:  # BERT's causal LM head is another model
        raise ValueError(f"{path}: model_type {model_type!r} is an encoder-only masked language "
                         f"model, which fxpar does not plan; {SUPPORTED_KINDS}")
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{path}: model_type {model_type!r} has no causal language model in "
                         f"transformers (AutoModelForCausalLM); {SUPPORTED_KINDS}")
    return _built(path, from_config, config)


def _vlm_small_config(arch: str, **overrides):
    """A vision-language arch at small sizes: Qwen2-VL's family of its own (a vision config of
    other fields, planner.models.hf_qwen_vl), the others as planner.models.hf_vlm makes them."""
    from planner.models import hf_qwen_vl, hf_vlm
    text = functools.partial(small_config, text_part=True)
    if arch in hf_qwen_vl.MODEL_TYPES:
        return hf_qwen_vl.small_config(arch, text, **overrides)
    return hf_vlm.small_config(arch, text, **overrides)


def _vlm_from_config(config):
    """The wrapped vision-language model of `config`: images of a fixed grid for Qwen2-VL's
    family, fixed-size images merged through get_placeholder_mask for the others."""
    from planner.models import hf_qwen_vl, hf_vlm
    return (hf_qwen_vl.from_config(config) if hf_qwen_vl.handles(config)
            else hf_vlm.from_config(config))


def _built(path: str, build, config):
    try:
        return build(config)
    except ValueError as err:  # fxpar's refusals, whole; transformers' own made one line
        raise ValueError(f"{path}: {' '.join(str(err).split())}") from None
    except Exception as err:  # noqa: BLE001 - as above, while building the modules
        raise ValueError(f"{path}: transformers cannot build the model ({_one_line(err)}): "
                         f"add or correct the config field it names") from None


# Keys of published config.json files that transformers converts rather than declares, and
# the maximum positions fxpar reads for the default sequence length of any family.
_CONVERTED_KEYS = {"torch_dtype", "rope_theta", "rope_scaling", "transformers_version",
                   "architectures", "_name_or_path", "auto_map", "max_position_embeddings",
                   "n_positions", "seq_length"}


def _check_keys(path: str, data: dict, cls) -> None:
    """A misspelt key would be kept as a stray attribute while the model is built from the
    default it meant to change (`num_hidden_layer`: 32 layers, silently). Keys the config class
    does not declare are otherwise legitimate: public config.json files carry their own
    (DeepSeek-V3's `scoring_func`, Qwen3's `head_dim`), kept as attributes the modelling code may
    read; a key is refused when it is a near spelling of a declared field the file does not give."""
    tf = _transformers()
    known = (set(inspect.signature(cls.__init__).parameters) | set(cls().to_dict())
             | set(getattr(cls, "attribute_map", {}) or {}) | set(tf.PretrainedConfig().to_dict())
             | _CONVERTED_KEYS)
    # (a public name of a private field, as transformers writes Gemma 3's pattern, is its own)
    stray = sorted(k for k in set(data) - known
                   if f"_{k}" not in known and not _has_effect(tf, data, k))
    typos = [(k, close[0]) for k in stray
             for close in [difflib.get_close_matches(k, sorted(known - set(data)), n=1,
                                                     cutoff=0.8)] if close]
    if typos:
        (key, meant), more = typos[0], [k for k, _ in typos[1:]]
        also = f"; {len(more)} more: {', '.join(more[:3])}" if more else ""
        raise ValueError(f"{path}: {key!r} is not a field of transformers' {cls.__name__} (did "
                         f"you mean {meant!r}?): the model would be built with its default "
                         f"instead{also}")


def _has_effect(tf, data: dict, key: str) -> bool:
    """Whether `key`, undeclared, still changes the config (a legacy name its constructor reads
    from **kwargs, as Gemma 3's sliding_window_pattern), rather than being kept as a stray."""
    def fields(d):
        try:
            out = tf.AutoConfig.for_model(**d).to_dict()
        except Exception:  # noqa: BLE001 - a config transformers rejects: said when it is built
            return None
        out.pop(key, None)
        return out
    return fields(data) != fields({k: v for k, v in data.items() if k != key})


def _one_line(err: Exception, limit: int = 300) -> str:
    """The error's text as one line, cut at `limit` characters (transformers lists hundreds of
    model types in some of its messages)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text_config(model):
    """The config of the model's language part (a vision-language model's text_config)."""
    config = model.model.config
    return getattr(config, "text_config", None) or config


def sequence_length(model: HFCausalLM) -> int:
    if isinstance(model, HFSeq2SeqLM):  # less the positions its family reserves
        return seq2seq_length(model)
    config = _text_config(model)
    # the encoder's positions where a model has two tables (LED: 16K encoder, 1K decoder)
    length = next((getattr(config, key) for key in ("n_positions", "max_position_embeddings",
                                                     "max_encoder_position_embeddings")
                   if getattr(config, key, None)), None)
    if not length:
        raise ValueError("the config has none of n_positions, max_position_embeddings and "
                         "max_encoder_position_embeddings: give the sequence length (--seq)")
    return int(length)


def vocab_size(model: HFCausalLM) -> int:
    return int(_text_config(model).vocab_size)


def example_inputs(model, batch: int, seq: int, device="meta",
                   generator: torch.Generator | None = None) -> tuple:
    """The inputs a model built here takes: (tokens, targets), or the model's own form (a
    vision-language model's tokens, images and targets); random unless on the meta device."""
    own = getattr(model, "example_inputs", None)
    if own is not None:
        return own(batch, seq, device=device, generator=generator)
    if str(device) == "meta":
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
        return tokens, tokens
    return tuple(torch.randint(0, vocab_size(model), (batch, seq), generator=generator)
                 for _ in "xy")


@dataclass(frozen=True)
class HFSpec:
    """A Hugging Face architecture at small sizes (see build_hf), with its random batch."""

    arch: str
    global_batch: int = 16
    overrides: tuple[tuple[str, object], ...] = ()
    seq: int | None = None      # None: the config's maximum positions
    # Inputs given to the model itself beside the tokens ("attention_mask", "position_ids"):
    # the transformers model is then trained as it is, its logits (a ModelOutput) through
    # loss_fn=planner.models.loss.causal_lm_loss, with train_step(tokens, *extra, targets).
    extra_inputs: tuple[str, ...] = ()
    # With an attention mask: targets at padded positions are -100, cross-entropy's ignore_index,
    # as fine-tuning data marks them (the samples then count different numbers of tokens).
    ignore_padding: bool = False

    def build(self):
        model = build_hf(self.arch, **dict(self.overrides))
        gen = torch.Generator().manual_seed(0)
        shape = (self.global_batch, self.seq or sequence_length(model))
        batch = example_inputs(model, *shape, device="cpu", generator=gen)
        if not self.extra_inputs:
            return model, batch
        from planner.models.loss import causal_lm_loss, with_loss
        extra = extra_batch(self.extra_inputs, shape, gen)
        targets = batch[1]
        if self.ignore_padding:
            mask = extra[self.extra_inputs.index("attention_mask")]
            targets = targets.masked_fill(mask == 0, -100)
        return with_loss(model.model, causal_lm_loss), (batch[0], *extra, targets)
