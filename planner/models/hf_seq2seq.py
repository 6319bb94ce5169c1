"""Hugging Face encoder-decoder language models (T5, BART, Pegasus, Marian, ...), built from a
config, no download.

`HFSeq2SeqLM` wraps a `*ForConditionalGeneration` so that it takes `(tokens, decoder_tokens,
targets)` - the encoder's tokens, the decoder's input tokens, and the token each decoder position
should predict - and returns the mean cross-entropy. The decoder's inputs are given rather than
made inside the graph from `labels=`: transformers would shift the labels right with config fields
(`decoder_start_token_id`) that torch.export cannot follow, and the shift pairs each position with
its neighbour.

Capture: torch.fx.symbolic_trace cannot follow transformers' Python control flow (T5's layer norm
tests its weight's dtype, the mask builders test shapes), so these models are captured with
torch.export, which runs the forward on the example inputs; with the decoder's tokens given it
meets no config lookup. The encoder's and the decoder's block lists are both split into pipeline
stages (passes.capture.trace), the encoder's output carried to every decoder stage.

`small_seq2seq_config(arch, **fields)` makes any text-to-text model_type of transformers
(`architectures()`) at small sizes; `HFSeq2SeqSpec` is the spec pooled ranks build the same
model and batch from.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from planner.models import hf_attention
from planner.models.hf_families import Family
from planner.models.hf_wrapper import HFWrapper, transformers_module as _transformers

# Small sizes that train on CPU ranks, by transformers' standard config names (each config's
# attribute_map translates them); both sides of the model take them. Any field can be
# overridden, a side's own one too (decoder_layers=4, num_decoder_layers=4).
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=256,
             max_position_embeddings=32)
# Each side's fields, by the sizes above, where the config's constructor takes them.
_SIDES = {
    "num_hidden_layers": ("encoder_layers", "decoder_layers", "num_layers", "num_decoder_layers",
                          "num_encoder_layers"),
    "num_attention_heads": ("encoder_attention_heads", "decoder_attention_heads", "num_heads",
                            "num_encoder_attention_heads", "num_decoder_attention_heads"),
    "vocab_size": ("src_vocab_size", "tgt_vocab_size", "decoder_vocab_size"),
    "max_position_embeddings": ("max_encoder_position_embeddings",
                                "max_decoder_position_embeddings"),
}
_DERIVED = {
    "encoder_ffn_dim": lambda s: 2 * s["hidden_size"],
    "decoder_ffn_dim": lambda s: 2 * s["hidden_size"],
    "d_ff": lambda s: 2 * s["hidden_size"],
    "d_kv": lambda s: s["hidden_size"] // s["num_attention_heads"],
    "d_model": lambda s: s["hidden_size"],
    "hidden_size": lambda s: s["hidden_size"],
    "attention_window": lambda s: 8,   # LED's local attention: a window within 32 tokens
}
# Fields whose value is a number of tokens (a relative-position model has no table of positions;
# the published T5 configs say n_positions).
_POSITIONS = ("max_position_embeddings", "n_positions", "max_encoder_position_embeddings")


def _is_dropout(name: str, value) -> bool:
    return (isinstance(value, float) and not isinstance(value, bool)
            and ("dropout" in name or "pdrop" in name) and value > 0)


def architectures() -> list[str]:
    """Every model_type of the installed transformers with a sequence-to-sequence LM that
    reads encoder tokens and decoder tokens (input_ids, decoder_input_ids) from one flat config;
    speech and multimodal models (their encoder reads features) and composite configs (an
    encoder config and a decoder config: EncoderDecoderModel, T5Gemma) are left out."""
    tf = _transformers()
    return sorted(t for t, cls in tf.CONFIG_MAPPING.items() if _text_to_text(tf, cls))


def is_seq2seq_arch(arch: str) -> bool:
    """Whether `arch` is one of architectures(), importing only its own modules."""
    tf = _transformers()
    return arch in tf.CONFIG_MAPPING.keys() and _text_to_text(tf, tf.CONFIG_MAPPING[arch])


def is_seq2seq(config) -> bool:
    """Whether a transformers config is of one of `architectures()`."""
    return is_seq2seq_arch(getattr(config, "model_type", None))


def _text_to_text(tf, config_cls) -> bool:
    if config_cls not in tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING or \
            getattr(config_cls, "sub_configs", None):
        return False
    takes = inspect.signature(tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[config_cls].forward)
    return {"input_ids", "decoder_input_ids"} <= set(takes.parameters)


# The families the tests train exactly against one process or plan (tests/dist/test_hf_seq2seq.py,
# tests/plan/test_seq2seq.py), with the fields that make them exercise a construct.
FAMILIES = (
    Family("t5", "relative position bias made in the first block from a trained embedding and "
           "reused by every block (under tp: each rank's heads, read through tp_copy so the "
           "embedding's gradient is summed), no 1/sqrt(d) scaling, attention width heads x "
           "d_kv (128) other than d_model (64), ReLU MLP, RMS norm without mean, tied "
           "embeddings with the decoder output scaled", (("d_kv", 16),),
           refuses=(("cp", "relative_attention_bias"),)),
    Family("t5", "T5 v1.1 / Flan-T5: gated-GELU MLP (two column-parallel inputs), untied head",
           (("feed_forward_proj", "gated-gelu"), ("tie_word_embeddings", False)),
           refuses=(("cp", "relative_attention_bias"),)),
    Family("mt5", "T5 v1.1 layout, untied head", refuses=(("cp", "relative_attention_bias"),)),
    Family("umt5", "a relative position bias of its own in every block, attention width 32 "
           "beside d_model 64", (("d_kv", 4),), refuses=(("cp", "relative_attention_bias"),)),
    Family("bart", "learned positions offset by 2, post-norm, GELU, biases everywhere, "
           "embedding layer norm, final logits bias; cp runs the cross-attention as a ring "
           "over the encoder's tokens"),
    Family("mbart", "pre-norm with a final layer norm on each side"),
    Family("pegasus", "sinusoidal positions, pre-norm"),
    Family("marian", "sinusoidal positions, scaled embeddings, final logits bias"),
)


# Masks of no padding that a family needs given: without them LongT5 and Switch Transformers
# make theirs with torch.ones(batch, length) (symbolic tracing cannot call it on a traced size)
# and under export build no block mask at all, and FSMT tests the decoder's tokens for padding (a
# branch on tensor values, which export cannot hold).
_FAMILY_INPUTS = {"longt5": ("attention_mask",), "switch_transformers": ("attention_mask",),
                  "fsmt": ("decoder_attention_mask",)}


class HFSeq2SeqLM(HFWrapper):
    """A transformers encoder-decoder LM trained on (tokens, decoder_tokens, targets)."""


    def forward(self, tokens, decoder_tokens, targets):
        """The mean cross-entropy of every decoder position against `targets`. The decoder's
        inputs are given (usually the targets shifted right behind a start token, made by the
        data loader): with `labels=` transformers would shift them inside the graph, reading
        config fields export cannot follow and pairing each position with its neighbour."""
        given = _FAMILY_INPUTS.get(self.model.config.model_type, ())
        masks = {name: torch.ones_like(decoder_tokens if name.startswith("decoder") else tokens)
                 for name in given}
        with hf_attention.plain_positions():
            logits = self.model(input_ids=tokens, decoder_input_ids=decoder_tokens,
                                use_cache=False, **masks).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def example_inputs(self, batch: int, seq: int, device="cpu",
                       generator: torch.Generator | None = None,
                       decoder_seq: int | None = None) -> tuple[torch.Tensor, ...]:
        """(tokens, decoder_tokens, targets): random tokens of the encoder's and the decoder's
        vocabularies, the decoder's tokens the targets shifted right behind token 0 (T5's and
        BART's start token is the padding id, made 0 at small sizes); the decoder is as long as
        the encoder unless `decoder_seq` says. On the meta device, zeros of those shapes."""
        source, target = vocab_sizes(self)
        dec = decoder_seq or seq
        _check_length(self, seq, dec)
        if str(device) == "meta":
            return tuple(torch.zeros(batch, n, dtype=torch.long, device="meta")
                         for n in (seq, dec, dec))
        gen = generator or torch.Generator().manual_seed(0)
        tokens = torch.randint(0, source, (batch, seq), generator=gen)
        targets = torch.randint(0, target, (batch, dec), generator=gen)
        start = torch.zeros(batch, 1, dtype=torch.long)
        return tokens, torch.cat([start, targets[:, :-1]], dim=1), targets

    def fxpar_plan_notes(self, example_inputs) -> tuple[str, ...]:
        """The plan's note on the two sequence lengths (its `seq` is the encoder's)."""
        enc, dec = (int(x.shape[1]) for x in example_inputs[:2])
        same = " (as many as the encoder's, by default)" if dec == enc else ""
        return (f"encoder-decoder: the encoder reads {enc} tokens per sample (the plan's seq), "
                f"the decoder {dec}{same}",)


def small_seq2seq_config(arch: str, **fields):
    """`arch`'s config at the small sizes above, both sides alike; dropout off (an override
    gives any rate); token ids outside the small vocabulary moved to 0."""
    tf = _transformers()
    if not is_seq2seq_arch(arch):
        known = architectures()
        close = difflib.get_close_matches(arch, known, n=3)
        raise ValueError(f"unknown encoder-decoder architecture {arch!r}: transformers "
                         f"{tf.__version__} has no text-to-text model of that model_type"
                         + (f"; did you mean {', '.join(close)}?" if close else
                            f" (known: {', '.join(known[:6])}, ...)")
                         + " (or give --hf-config FILE.json)")
    cls = tf.CONFIG_MAPPING[arch]
    own = dict(getattr(cls, "attribute_map", {}) or {})
    accepted = set(inspect.signature(cls.__init__).parameters)
    sizes = {**SMALL, **{k: v for k, v in fields.items() if k in SMALL}}
    kwargs = {own.get(k, k): v for k, v in sizes.items() if own.get(k, k) in accepted}
    for standard, names in _SIDES.items():
        kwargs.update({name: sizes[standard] for name in names if name in accepted})
    kwargs.update({name: rule(sizes) for name, rule in _DERIVED.items() if name in accepted})
    if not any(name in accepted for name in _POSITIONS):
        kwargs["n_positions"] = sizes["max_position_embeddings"]  # as T5's published configs
    defaults = cls()
    for name, value in vars(defaults).items():
        if name in accepted and (_is_dropout(name, value) or _is_layerdrop(name, value)):
            kwargs[name] = 0.0
    vocab = min([sizes["vocab_size"], *(kwargs[n] for n in _SIDES["vocab_size"] if n in kwargs)])
    for name, value in vars(defaults).items():
        if name.endswith("token_id") and isinstance(value, int) and value >= vocab:
            kwargs[name] = 0
    kwargs["use_cache"] = False  # training: a KV cache would only be built and thrown away
    known_fields = accepted | set(own) | set(defaults.to_dict()) | set(_POSITIONS)
    for key, value in fields.items():
        name = own.get(key, key)
        if key in SMALL and name not in accepted:
            continue  # a size both sides took above under their own names
        if name not in known_fields:
            close = difflib.get_close_matches(name, sorted(known_fields), n=1)
            raise ValueError(f"{arch} has no config field {key!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f": transformers' {cls.__name__} would keep it unused")
        kwargs[name] = value
    return tf.AutoConfig.for_model(arch, **kwargs)


def _is_layerdrop(name: str, value) -> bool:
    return name.endswith("layerdrop") and isinstance(value, float) and value > 0


def from_config(config) -> HFSeq2SeqLM:
    """The encoder-decoder LM of `config`, with PyTorch's fused attention where the architecture
    has it (fxpar's registration where it looks attention up by name: planner.models.hf_attention)
    and its eager attention where it has none."""
    tf = _transformers()
    drops = [name for name, value in config.to_dict().items() if _is_layerdrop(name, value)]
    if drops:
        raise ValueError(f"{', '.join(f'{n}={getattr(config, n)}' for n in drops)}: layerdrop "
                         f"skips whole layers at random in training, a branch a captured graph "
                         f"cannot hold; set {' and '.join(drops)} to 0")
    model_cls = tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(config)]
    fused = getattr(model_cls, "_supports_sdpa", False)
    interface = getattr(model_cls, "_supports_attention_backend", False)
    attention = hf_attention.register() if fused and interface else "sdpa" if fused else "eager"
    model = tf.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=attention)
    return HFSeq2SeqLM(model)


def build_seq2seq(arch: str, **fields) -> HFSeq2SeqLM:
    """A randomly initialised encoder-decoder model of `arch` (t5, bart, ...) at small sizes."""
    return from_config(small_seq2seq_config(arch, **fields))


def vocab_sizes(model: HFSeq2SeqLM) -> tuple[int, int]:
    """(encoder vocabulary, decoder vocabulary): FSMT and Marian may have two."""
    config = model.model.config
    source = getattr(config, "src_vocab_size", None) or config.vocab_size
    target = (getattr(config, "tgt_vocab_size", None) or getattr(config, "decoder_vocab_size", None)
              or config.vocab_size)
    return int(source), int(target)


def sequence_length(model: HFSeq2SeqLM) -> int:
    """The most tokens the model reads on each side: the config's maximum positions (a
    relative-position model like T5 has no table of positions; its published configs say
    n_positions), less the positions its family reserves (_RESERVED_POSITIONS)."""
    config = model.model.config
    for name in _POSITIONS:
        length = getattr(config, name, None)
        if isinstance(length, int) and length > 0:
            return length - _reserved(config)
    raise ValueError(f"the {config.model_type} config states no maximum positions "
                     f"({', '.join(_POSITIONS)}): give the sequence length (--seq)")


# Positions of a family's table that no token of a sequence starting at 0 reads. ProphetNet
# numbers its tokens from pad_token_id + 1 and its decoder's predicting stream reads one position
# further, unclamped: pad_token_id + 2 rows are spare. BART's (and mBART's, ...) learned table
# has its offset of 2 built in (max_position_embeddings + 2 rows), M2M-100's and NLLB's
# sinusoidal table grows with the sequence: they read max_position_embeddings tokens.
_RESERVED_POSITIONS = {"prophetnet": lambda config: (config.pad_token_id or 0) + 2}


def _reserved(config) -> int:
    rule = _RESERVED_POSITIONS.get(config.model_type)
    return rule(config) if rule else 0


def _check_length(model: HFSeq2SeqLM, *lengths: int) -> None:
    """A family that reserves positions fails past its length inside transformers' own code
    (an index or a view out of range): refused here, naming the length to give."""
    config = model.model.config
    most = sequence_length(model) if config.model_type in _RESERVED_POSITIONS else None
    if most is not None and max(lengths) > most:
        raise ValueError(f"{config.model_type} reads at most {most} tokens per side with "
                         f"max_position_embeddings={config.max_position_embeddings} (its "
                         f"positions start after pad_token_id={config.pad_token_id}, and its "
                         f"decoder's predicting stream reads one further): give --seq {most} "
                         f"or less, or a config with more positions")


@dataclass(frozen=True)
class HFSeq2SeqSpec:
    """An encoder-decoder architecture at small sizes (see build_seq2seq), with its random
    batch: encoder tokens, decoder tokens (the targets shifted right behind token 0), targets."""

    arch: str
    global_batch: int = 16
    overrides: tuple[tuple[str, object], ...] = ()
    seq: int | None = None          # the encoder's tokens; None: the config's maximum positions
    decoder_seq: int | None = None  # the decoder's tokens; None: as many as the encoder's

    def build(self):
        model = build_seq2seq(self.arch, **dict(self.overrides))
        gen = torch.Generator().manual_seed(0)
        return model, model.example_inputs(self.global_batch, self.seq or sequence_length(model),
                                           generator=gen, decoder_seq=self.decoder_seq)
