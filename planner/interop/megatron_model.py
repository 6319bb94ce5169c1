"""A model's definition as Megatron-LM's flags state it, both ways (megatron/training/arguments.py):
the flags `--emit megatron` writes for a model, with what no flag states and the nearest written
instead, and the check `--from-megatron` makes of flags against the model, each property given
or implied by its flags' absence (Megatron-LM's defaults: a GELU MLP, LayerNorm, learned
positions, biases on every linear, rotary base 10000, norm epsilon 1e-5, head width hidden/heads).

Both directions go through one set of properties (`ITEMS`): the model's value of each
(`statement`), the value flags state (`Item.of_flags`) and the flags that state a value
(`_flags_for`), so what is emitted reads back as the model and a contradiction names its flag.
A mixture of experts and multi-latent attention are properties the same way
(planner.interop.megatron_moe)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from planner.interop import megatron_moe as moe
from planner.interop.model_facts import ModelFacts

SILU = frozenset({"silu", "swish"})
GELU = frozenset({"gelu", "gelu_python"})
GELU_TANH = frozenset({"gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_accurate"})
# Megatron-LM's MLPs: the flag that picks each, and how it is said
MLPS = {"gelu": ((), "GELU"), "openai-gelu": (("--openai-gelu",), "tanh-approximated GELU"),
        "squared-relu": (("--squared-relu",), "squared ReLU"),
        "swiglu": (("--swiglu",), "SiLU-gated (SwiGLU)"),
        "quick-geglu": (("--quick-geglu",), "quick-GELU-gated, x·sigmoid(1.702x)")}
POSITIONS = ("learned_absolute", "rope", "mrope", "relative", "none")
NONE = "absent"  # a property the model lacks (no window, no rotary scaling): a value, unlike None
# the size flags: what each sizes, and the ModelFacts field
SIZES = {"--num-layers": ("number of layers", "layers"),
         "--hidden-size": ("hidden size", "hidden"), "--ffn-hidden-size": ("MLP width", "ffn"),
         "--num-attention-heads": ("number of attention heads", "heads"),
         "--vocab-size": ("vocabulary", "vocab")}


@dataclass
class Statement:
    """The model as Megatron-LM states it: each property's value (None: the model does not say)
    and what no flag states, with the nearest chosen."""
    values: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _close(a, b) -> bool:
    """Equal, numbers to float precision (a rotary base of 1e6 is --rotary-base 1000000)."""
    if all(isinstance(x, (int, float)) for x in (a, b)):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def _number(x: float) -> str:
    """An integral value as an integer (Megatron-LM's --rotary-base is an int flag), any other
    in the shortest form that reads back equal (repr: 0.6666666666666666, not :g's 0.666667)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# ----------------------------------------------------------------------------------------------
# The model's value of each property, and the nearest where no flag states it
# ----------------------------------------------------------------------------------------------
def _mlp(facts: ModelFacts, notes: list[str]) -> str:
    gated = facts.gated if facts.gated is not None else facts.arch == "llama"
    act = (facts.activation or ("silu" if gated else "gelu")).lower()
    if gated and act in SILU:
        return "swiglu"
    if not gated and act in GELU:
        return "gelu"
    if not gated and act in GELU_TANH:
        return "openai-gelu"
    if not gated and act == "relu2":
        return "squared-relu"
    if gated and act == "quick_gelu":
        return "quick-geglu"
    near = ("quick-geglu" if act in GELU | GELU_TANH else "swiglu") if gated else "gelu"
    kinds = ("SiLU (--swiglu) and quick-GELU (--quick-geglu)" if gated else
             "GELU (default), tanh-approximated GELU (--openai-gelu) and squared ReLU "
             "(--squared-relu)")
    notes.append(f"the MLP's activation {facts.activation}, {'gated' if gated else 'plain'}: "
                 f"Megatron-LM's {'gated' if gated else 'plain'} MLPs are {kinds}; nearest: "
                 f"{' '.join(MLPS[near][0]) or 'its GELU'}")
    return near


def _norm(facts: ModelFacts, notes: list[str]) -> str:
    kind = facts.norm or ("RMSNorm" if facts.arch == "llama" else "LayerNorm")
    if kind in ("RMSNorm", "LayerNorm"):
        return kind
    notes.append(f"{kind}: Megatron-LM's LayerNorm learns a weight and a bias; nearest: "
                 f"--normalization LayerNorm")
    return "LayerNorm"


def _qk_norm(facts: ModelFacts, notes: list[str]) -> bool:
    if facts.qk_norm == "all":
        notes.append("q/k norms over all heads together: Megatron-LM's --qk-layernorm norms "
                     "each head; nearest: --qk-layernorm")
    return facts.qk_norm is not None


def _position(facts: ModelFacts, notes: list[str]) -> str:
    kind = facts.position or ("rope" if facts.arch == "llama" else "learned")
    if kind == "alibi":
        notes.append("ALiBi attention biases: Megatron-LM has none; nearest: "
                     "--position-embedding-type none")
    return {"rope": "rope", "learned": "learned_absolute"}.get(kind, "none")


# llama3's scaled rotary as Megatron-LM's --use-rope-scaling applies it: only its factor is a
# flag (megatron/core/models/common/embeddings/rope_utils.py fixes the rest)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


# what --emit megatron says of yarn, which --position-embedding-type yarn (newer Megatron-LM) states
YARN_NOTE = "a scaled rotary embedding (yarn)"


def _rotary_base(facts: ModelFacts, notes: list[str]) -> float | None:
    """Megatron-LM's --rotary-base is an integer flag: a fractional base is not stated."""
    theta = facts.rope_theta
    if theta is None or float(theta).is_integer():
        return theta
    notes.append(f"the rotary base {theta!r}: Megatron-LM's --rotary-base takes an integer; "
                 f"nearest: {round(theta)}")
    return float(round(theta))


def _rope_scaling(facts: ModelFacts, notes: list[str]) -> float | str:
    if not facts.rope_scaling:
        return NONE
    params = dict(facts.rope_params)
    if facts.rope_scaling == "llama3" and all(
            _close(params.get(k, v), v) for k, v in LLAMA3_FIXED.items()) and "factor" in params:
        return float(params["factor"])
    notes.append(f"a scaled rotary embedding ({facts.rope_scaling}): Megatron-LM's "
                 f"--use-rope-scaling is llama3's with low/high frequency factors 1/4 over 8192 "
                 f"positions; nearest: unscaled")
    return NONE


def _biases(facts: ModelFacts, notes: list[str]) -> str:
    """"all", "none" or "qkv" (q/k/v only): the three Megatron-LM states."""
    gpt = facts.arch == "gpt"
    have = {name: gpt if on is None else on for name, on in (
        ("the q/k/v projections", facts.qkv_bias), ("the attention's output projection",
                                                    facts.out_bias),
        ("the MLP", facts.mlp_bias))}
    qkv, out, mlp = have.values()
    if qkv and out and mlp:
        return "all"
    if not (out or mlp):
        return "qkv" if qkv else "none"
    near = "all" if mlp else ("qkv" if qkv else "none")
    on = [n for n, b in have.items() if b]
    off = [n for n, b in have.items() if not b]
    said = {"all": "biases everywhere", "qkv": "--disable-bias-linear --add-qkv-bias",
            "none": "--disable-bias-linear"}
    notes.append(f"biases on {' and '.join(on)} but not {' or '.join(off)}: Megatron-LM has "
                 f"biases on every linear, on none (--disable-bias-linear) or on q/k/v only "
                 f"(--add-qkv-bias); nearest: {said[near]}")
    return near


def _window_skip(layers: tuple[bool, ...] | None):
    """Megatron-LM's --window-attn-skip-freq of the sliding layers: "none" (all), N (every N-th
    layer full), or the list of them (1: sliding)."""
    if layers is None or all(layers):
        return NONE
    for n in range(2, len(layers) + 1):
        if all(slides == ((i + 1) % n != 0) for i, slides in enumerate(layers)):
            return n
    return tuple(int(s) for s in layers)


def statement(facts: ModelFacts, seq: int) -> Statement:
    """What the model is, property by property, as Megatron-LM's flags can say it."""
    notes: list[str] = []
    position = _position(facts, notes)
    rope = position == "rope"
    values = {
        # latent attention's widths are its own flags; its head_dim is only the rotary part
        "groups": facts.kv_heads, "kv_channels": None if facts.mla else facts.kv_channels,
        "positions": (facts.max_positions or seq) if position == "learned_absolute" else None,
        "mlp": _mlp(facts, notes), "norm": _norm(facts, notes),
        "norm_1p": facts.norm_one_plus, "qk_norm": _qk_norm(facts, notes), "position": position,
        "rotary_base": _rotary_base(facts, notes) if rope else None,
        "rotary_percent": facts.rotary_fraction if rope else None,
        "rope_scaling": _rope_scaling(facts, notes) if rope else None,
        # Hugging Face's window counts the query itself; Megatron-LM's left side does not
        "window": (facts.window - 1, 0) if facts.window else NONE,
        "window_skip": _window_skip(facts.window_layers) if facts.window else NONE,
        "biases": _biases(facts, notes), "norm_eps": facts.norm_eps, "tie": facts.tie,
        **moe.values(facts),
    }
    if facts.rope_scaling and not rope:
        notes.append(f"a scaled rotary embedding ({facts.rope_scaling}) of a model without "
                     f"rotary positions")
    notes += [f"{what}: no Megatron-LM flag states it" for what in facts.extra]
    return Statement(values, notes)


# ----------------------------------------------------------------------------------------------
# Each property: what it is, the flags that state a value, and the value flags state
# ----------------------------------------------------------------------------------------------
def _float(f: dict, flag: str, default: float) -> float:
    if flag not in f:
        return default
    try:
        return float(f[flag])
    except ValueError:
        raise ValueError(f"{flag}: expected a number, got {f[flag]!r}") from None


def _mlp_of_flags(f: dict, facts) -> str:
    on = [name for name, (flags, _) in MLPS.items() if flags and f.get(flags[0])]
    if len(on) > 1:
        raise ValueError(f"{MLPS[on[0]][0][0]} and {MLPS[on[1]][0][0]} are exclusive (each "
                         f"picks Megatron-LM's MLP)")
    return on[0] if on else "gelu"


def _position_of_flags(f: dict, facts) -> str:
    position = f.get("--position-embedding-type")
    if position is not None and position not in POSITIONS + ("yarn",):
        raise ValueError(f"--position-embedding-type {position!r}: Megatron-LM knows "
                         f"{', '.join(POSITIONS)} and yarn")
    if position == "yarn":  # newer Megatron-LM: rotary positions, yarn-scaled
        if facts.rope_scaling != "yarn":
            raise ValueError(f"--position-embedding-type yarn contradicts the model {facts.name}, "
                             f"whose rotary embedding is {facts.rope_scaling or 'not'} scaled, not "
                             f"yarn's: give --position-embedding-type rope")
        return "rope"
    if f.get("--use-rotary-position-embeddings"):
        position = position or "rope"
    if f.get("--no-position-embedding"):
        position = position or "none"
    return position or "learned_absolute"


def _norm_of_flags(f: dict, facts) -> str:
    norm = f.get("--normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization {norm!r}: Megatron-LM knows LayerNorm and RMSNorm")
    return norm


def _biases_of_flags(f: dict, facts) -> str:
    if not f.get("--disable-bias-linear"):
        return "all"
    return "qkv" if f.get("--add-qkv-bias") else "none"


def _groups_of_flags(f: dict, facts) -> int:
    if not f.get("--group-query-attention"):
        return f.get("--num-attention-heads", facts.heads)
    return f.get("--num-query-groups", 1)


def _kv_channels_of_flags(f: dict, facts) -> int:
    return f.get("--kv-channels") or (f.get("--hidden-size", facts.hidden) //
                                      f.get("--num-attention-heads", facts.heads))


def _window_of_flags(f: dict, facts):
    text = f.get("--window-size")
    if text is None:
        return NONE
    m = re.fullmatch(r"\(?\s*(-?\d+)\s*,\s*(-?\d+)\s*\)?", str(text))
    if m is None:
        raise ValueError(f"--window-size {text!r}: expected two integers, left,right")
    window = (int(m.group(1)), int(m.group(2)))
    return NONE if window[0] < 0 and window[1] <= 0 else window  # (-1, 0): plain causal


def _window_skip_of_flags(f: dict, facts):
    text = f.get("--window-attn-skip-freq")
    if text is None:
        return NONE
    text = str(text)
    if text.isdigit():
        return int(text)
    if re.search(r"[^,\d\[\]()+* ]", text):
        raise ValueError(f"--window-attn-skip-freq {text!r}: expected N or a list expression "
                         f"such as '([1]*3+[0])*2'")
    try:  # as Megatron-LM reads it (arguments.py's moe_freq_type): a list expression
        pattern = tuple(bool(x) for x in eval(text, {"__builtins__": {}}))  # noqa: S307
    except Exception:  # noqa: BLE001 - a malformed expression of the allowed characters
        raise ValueError(f"--window-attn-skip-freq {text!r} is not a list expression") from None
    return _window_skip(pattern)


def _switch(flag: str):
    return lambda f, facts: bool(f.get(flag))


def _rotary(flag: str, default: float):
    return lambda f, facts: _float(f, flag, default)


def _rope_scaling_of_flags(f: dict, facts):
    if not f.get("--use-rope-scaling"):
        return NONE
    return _float(f, "--rope-scaling-factor", 8.0)


def _positions_of_flags(f: dict, facts):
    return f.get("--max-position-embeddings") if \
        _position_of_flags(f, facts) == "learned_absolute" else None


@dataclass(frozen=True)
class Item:
    key: str
    what: str                       # "MLP", "rotary base"
    flags: tuple[str, ...]          # the flags that state it
    of_flags: object                # (flags, facts) -> value with Megatron-LM's defaults (None:
    #                                 the flags leave it open, as --max-position-embeddings)
    say: object = str               # value -> words
    # whether its absence states a default, given what the flags state (the rotary base: with
    # rotary positions only)
    applies: object = lambda stated: True
    verb: str = "is"


def _flags_for(key: str, value, facts: ModelFacts | None = None) -> list[str]:
    """The flags that state `value` of property `key` (none for Megatron-LM's default)."""
    if value is None or value == NONE:
        return []
    if key in moe.FLAGS:
        return moe.flags_for(key, value)
    if key == "groups":
        return [] if facts and value == facts.heads else [
            "--group-query-attention", f"--num-query-groups {value}"]
    if key == "kv_channels":
        return [] if facts and value == facts.hidden // facts.heads else [f"--kv-channels {value}"]
    if key == "positions":
        return [f"--max-position-embeddings {value}"]
    if key == "mlp":
        return list(MLPS[value][0])
    if key == "norm":
        return [] if value == "LayerNorm" else [f"--normalization {value}"]
    if key == "position":
        return [] if value == "learned_absolute" else [f"--position-embedding-type {value}"]
    if key == "rotary_base":
        return [] if _close(value, 10000.0) else [f"--rotary-base {_number(value)}"]
    if key == "rotary_percent":
        return [] if _close(value, 1.0) else [f"--rotary-percent {_number(value)}"]
    if key == "rope_scaling":
        return ["--use-rope-scaling", f"--rope-scaling-factor {_number(value)}"]
    if key == "window":
        return [f"--window-size {value[0]},{value[1]}"]
    if key == "window_skip":
        text = str(value) if isinstance(value, int) else "[" + ",".join(map(str, value)) + "]"
        return [f"--window-attn-skip-freq {text}"]
    if key == "biases":
        return {"all": [], "none": ["--disable-bias-linear"],
                "qkv": ["--disable-bias-linear", "--add-qkv-bias"]}[value]
    if key == "norm_eps":
        return [] if _close(value, 1e-5) else [f"--norm-epsilon {_number(value)}"]
    if key == "tie":
        return [] if value else ["--untie-embeddings-and-output-weights"]
    flag = {"norm_1p": "--apply-layernorm-1p", "qk_norm": "--qk-layernorm"}[key]
    return [flag] if value else []


def _roped(stated: dict) -> bool:
    return stated["position"] == "rope"


_BIASES = {"all": "on every linear", "none": "on no linear",
           "qkv": "on the q/k/v projections only"}
ITEMS = (
    Item("groups", "number of key/value heads", ("--group-query-attention", "--num-query-groups"),
         _groups_of_flags),
    Item("kv_channels", "head width", ("--kv-channels",), _kv_channels_of_flags),
    Item("positions", "number of learned positions", ("--max-position-embeddings",),
         _positions_of_flags),
    Item("mlp", "MLP", ("--swiglu", "--openai-gelu", "--squared-relu", "--quick-geglu"),
         _mlp_of_flags, lambda v: MLPS[v][1]),
    Item("norm", "normalization", ("--normalization",), _norm_of_flags),
    Item("norm_1p", "norm's scale", ("--apply-layernorm-1p",), _switch("--apply-layernorm-1p"),
         lambda v: "1 + weight" if v else "its weight"),
    Item("qk_norm", "q/k normalization", ("--qk-layernorm",), _switch("--qk-layernorm"),
         lambda v: "present" if v else "absent"),
    Item("position", "position embedding", ("--position-embedding-type",
                                            "--use-rotary-position-embeddings",
                                            "--no-position-embedding"), _position_of_flags),
    Item("rotary_base", "rotary base", ("--rotary-base",), _rotary("--rotary-base", 10000.0),
         _number, applies=_roped),
    Item("rotary_percent", "share of each head the rotary turns", ("--rotary-percent",),
         _rotary("--rotary-percent", 1.0), _number, applies=_roped),
    Item("rope_scaling", "rotary scaling", ("--use-rope-scaling", "--rope-scaling-factor"),
         _rope_scaling_of_flags, lambda v: v if v == NONE else f"llama3's, factor {_number(v)}",
         applies=_roped),
    Item("window", "sliding attention window (left, right)", ("--window-size",),
         _window_of_flags, lambda v: v if v == NONE else f"{v[0]},{v[1]}"),
    Item("window_skip", "layers with full attention among the sliding ones",
         ("--window-attn-skip-freq",), _window_skip_of_flags, str,
         applies=lambda stated: stated["window"] != NONE),
    Item("biases", "linear biases", ("--disable-bias-linear", "--add-qkv-bias"),
         _biases_of_flags, _BIASES.get, verb="are"),
    Item("norm_eps", "norm epsilon", ("--norm-epsilon",),
         lambda f, facts: _float(f, "--norm-epsilon", 1e-5), _number),
    Item("tie", "output layer", ("--untie-embeddings-and-output-weights",),
         lambda f, facts: not f.get("--untie-embeddings-and-output-weights"),
         lambda v: "tied to the embedding" if v else "untied"),
) + tuple(Item(*spec) for spec in moe.SPECS)
# The flags that define the model: given any, the flags state it, and what they leave out means
# Megatron-LM's default
MODEL_FLAGS = frozenset(SIZES) | {flag for item in ITEMS for flag in item.flags
                                  if item.key != "positions"}


# Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by (default 128)
# x tp rows (megatron/training/tokenizer: _vocab_size_with_padding): more embedding and head
VOCAB_DIVISOR = 128


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    step = divisor * tp
    return -(-vocab // step) * step


def vocab_divisor(vocab: int, tp: int) -> int:
    """The largest --make-vocab-size-divisible-by (a power of two up to Megatron-LM's 128) that
    leaves the vocabulary unpadded at tp; 1 where none does (the vocabulary is not a multiple
    of tp: Megatron-LM pads it whatever the flag, which `vocab_padding_note` says)."""
    return next((d for d in (128, 64, 32, 16, 8, 4, 2) if vocab % (d * tp) == 0), 1)


def vocab_padding_note(vocab: int, divisor: int, tp: int) -> str | None:
    padded = padded_vocab(vocab, divisor, tp)
    if padded == vocab:
        return None
    return (f"Megatron-LM pads the vocabulary from {vocab} to {padded} rows (a multiple of "
            f"--make-vocab-size-divisible-by {divisor} x tp {tp}); priced with the model's "
            f"{vocab} (the {padded - vocab} extra rows are "
            f"{100 * (padded - vocab) / vocab:.2g}% more embedding and head)")


def emitted_flags(facts: ModelFacts, seq: int) -> tuple[list[str], list[str]]:
    """(the flags that define the model, what they cannot state), in arguments.py's order."""
    told = statement(facts, seq)
    v = told.values
    flags = [f"--num-layers {facts.layers}", f"--hidden-size {facts.hidden}",
             f"--ffn-hidden-size {facts.ffn}", f"--num-attention-heads {facts.heads}"]
    flags += _flags_for("groups", v["groups"], facts)
    flags += _flags_for("kv_channels", v["kv_channels"], facts)
    for key in ("mla", "kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_dim", "v_head_dim"):
        flags += _flags_for(key, v[key], facts)
    # a learned table's rows; rotary positions have none: any bound on the sequence will do
    positions = v["positions"] or max(facts.max_positions or seq, seq)
    flags += [f"--seq-length {seq}", f"--max-position-embeddings {positions}",
              f"--vocab-size {facts.vocab}"]
    for key in ("mlp", "norm", "norm_1p", "qk_norm", "position", "rotary_base",
                "rotary_percent", "rope_scaling", "window", "window_skip", "biases", "norm_eps",
                "tie", "experts", "top_k", "moe_ffn", "shared_ffn", "moe_layers", "score",
                "pre_softmax", "scale", "router_groups", "group_topk", "expert_bias"):
        flags += _flags_for(key, v[key], facts)
    return flags, told.notes


def check(f: dict, facts: ModelFacts, seq: int | None, notes: list[str]) -> None:
    """Flags that define the model must be the model, given or implied by absence (a
    contradiction is an error naming the flag); flags of the parallel layout alone are priced
    as the model, which a note says."""
    for flag, (noun, name) in SIZES.items():
        if flag in f and f[flag] != getattr(facts, name):
            raise ValueError(f"{flag} {f[flag]} contradicts the model {facts.name}, whose {noun} "
                             f"is {getattr(facts, name)} (the model comes from "
                             f"--model/--hf-config)")
    if not set(f) & MODEL_FLAGS:
        notes.append(f"the flags do not define the model (no --num-layers, --swiglu, ...): "
                     f"priced as {facts.name}, as --model/--hf-config gives it")
        return
    told = statement(facts, seq or facts.seq)
    stated = {item.key: item.of_flags(f, facts) for item in ITEMS}
    wrong = []  # every difference at once: a user fixes them in one go, not one per run
    for explicit in (True, False):  # what the flags say first, then what their absence says
        for item in ITEMS:
            ours, theirs = told.values[item.key], stated[item.key]
            if ours is None or theirs is None or _close(theirs, ours):
                continue
            written = [flag for flag in item.flags if flag in f]
            if explicit and written:
                wrong.append(_contradiction(item, f, written, theirs, ours, facts))
            if not (explicit or written) and item.applies(stated):
                wrong.append(_absent(item, theirs, ours, facts))
    if wrong:
        raise ValueError("; ".join(wrong))
    yarn = f.get("--position-embedding-type") == "yarn"  # the yarn scaling stated, not its
    #                                                         parameters
    notes += [f"not in the flags (priced as the model {facts.name}): {note}"
              for note in told.notes if not (yarn and note.startswith(YARN_NOTE))]
    if yarn:
        notes.append("--position-embedding-type yarn: the model's yarn-scaled rotary embedding "
                     "(its scaling parameters are not checked)")


def _contradiction(item: Item, f: dict, written, theirs, ours, facts: ModelFacts) -> str:
    text = " ".join(flag if f[flag] is True else f"{flag} {f[flag]}" for flag in written)
    right = " ".join(_flags_for(item.key, ours, facts)) or f"by leaving out {' and '.join(written)}"
    return (f"{text} contradicts the model {facts.name}, whose {item.what} {item.verb} "
            f"{item.say(ours)}, not {item.say(theirs)} (Megatron-LM states it "
            f"{'with ' if right[0] == '-' else ''}{right})")


def _absent(item: Item, theirs, ours, facts: ModelFacts) -> str:
    add = " ".join(_flags_for(item.key, ours, facts))
    return (f"without {add} Megatron-LM's {item.what} {item.verb} {item.say(theirs)} (its "
            f"default), not the model {facts.name}'s {item.say(ours)}: add {add}")
