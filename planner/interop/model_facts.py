"""What a model is, for the configurations that build it elsewhere: its sizes and its definition
(MLP, norms, positions, biases, attention window, ...), read from a preset's architecture or from a
Hugging Face model's config and modules (planner.interop.megatron_model states them as Megatron-LM
flags; --emit torchtitan names the sizes to match).

A Hugging Face model is read the same way whatever its family: the config's standard fields
(head_dim, rope parameters, sliding_window with layer_types, soft-capping, multipliers) and the
modules of one block (which linears have biases, whether the MLP is gated, the norms' kind and
number, q/k norms), so a family nobody listed is described by what it has, not by its name."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: what Megatron-LM's --num-experts and --moe-* flags state."""
    count: int
    top_k: int
    ffn: int                        # one expert's width
    shared_ffn: int | None = None   # the shared experts' width, all of them together
    layers: tuple[bool, ...] | None = None  # which layers have experts (None: every layer)
    score: str = "softmax"          # the router's score function ("softmax" or "sigmoid")
    pre_softmax: bool = False       # softmax over all experts, top-k not renormalised
    scale: float = 1.0              # the routed weights' scaling factor
    groups: int = 1                 # group-limited routing: groups, and groups per token
    group_topk: int = 1
    expert_bias: bool = False       # a score correction bias chooses the top-k (aux-loss free)


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention's widths (Megatron-LM's --multi-latent-attention flags)."""
    kv_lora_rank: int
    q_lora_rank: int | None         # None: queries projected directly
    qk_head_dim: int                # the part of each head without positions (qk_nope_head_dim)
    qk_pos_dim: int                 # the rotary part (qk_rope_head_dim)
    v_head_dim: int


@dataclass(frozen=True)
class ModelFacts:
    name: str
    arch: str            # "gpt" (LayerNorm, GELU, learned positions) or "llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    tie: bool
    global_batch: int = 16
    dtype_bytes: int = 2  # what fxpar prices: presets train in bf16, a module in its own dtype
    # The definition beside the sizes (None: the model does not say; a preset states its arch's)
    qkv_bias: bool | None = None     # biases on the q/k/v projections
    out_bias: bool | None = None     # on the attention's output projection
    mlp_bias: bool | None = None     # on the MLP's linears
    rope_theta: float | None = None  # rotary base
    rope_scaling: str | None = None  # a scaled rotary's type ("llama3", "yarn", ...)
    rope_params: tuple = ()          # its parameters, (name, value) pairs
    norm_eps: float | None = None
    activation: str | None = None    # the config's hidden_act
    gated: bool | None = None        # the MLP is a gated unit (gate and up projections)
    head_dim: int | None = None      # per-head width, where it is not hidden / heads
    max_positions: int | None = None  # the config's positions (a learned table's rows)
    position: str | None = None      # "rope", "learned", "none" or "alibi"
    rotary_fraction: float = 1.0     # the share of each head's width the rotary turns
    norm: str | None = None          # "RMSNorm", "LayerNorm", "LayerNorm without bias", ...
    norm_one_plus: bool = False      # the norm scales by (1 + weight) (Gemma)
    qk_norm: str | None = None       # "head" (each head's q and k normed) or "all" (all heads)
    window: int | None = None        # sliding-window attention: keys a query sees, itself too
    window_layers: tuple[bool, ...] | None = None  # which layers slide (None: all)
    extra: tuple[str, ...] = ()      # what no field above says (soft-capping, scalings, ...)
    experts: Experts | None = None   # a mixture of experts in place of (some) MLPs
    mla: MLA | None = None           # multi-latent attention (DeepSeek-V2/V3)

    @property
    def linear_bias(self) -> bool | None:
        """Biases on the linears other than q/k/v."""
        if self.out_bias is None and self.mlp_bias is None:
            return None
        return bool(self.out_bias or self.mlp_bias)

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden // self.heads


def facts_of_config(config) -> ModelFacts:
    """A preset's facts: its architecture's definition (planner.models.presets.ModelConfig)."""
    gpt = config.arch == "gpt"
    return ModelFacts(config.name, config.arch, config.layers, config.hidden, config.heads,
                      config.n_kv_heads, config.ffn_hidden, config.vocab, config.seq, config.tie,
                      config.global_batch, qkv_bias=gpt, out_bias=gpt, mlp_bias=gpt,
                      activation="gelu" if gpt else "silu", gated=not gpt,
                      position="learned" if gpt else "rope",
                      norm="LayerNorm" if gpt else "RMSNorm", experts=_preset_experts(config))


def _preset_experts(config) -> Experts | None:
    """planner.models.moe's mixture: its first dense_layers blocks keep a dense MLP."""
    if not getattr(config, "experts", 0):
        return None
    ffn = config.expert_ffn or config.ffn_hidden
    dense = config.dense_layers
    return Experts(config.experts, config.top_k, ffn,
                   config.shared_experts * ffn if config.shared_experts else None,
                   (False,) * dense + (True,) * (config.layers - dense) if dense else None,
                   config.router, False, float(config.route_scale), config.expert_groups,
                   config.topk_groups)


def facts_of_hf(model, seq: int, global_batch: int = 16) -> ModelFacts:
    """From a planner.models.hf model: its transformers config and the modules of one block."""
    c = getattr(model.model.config, "text_config", None) or model.model.config
    get = lambda *names, default=None: next((getattr(c, n) for n in names  # noqa: E731
                                             if getattr(c, n, None) is not None), default)
    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    layers = get("num_hidden_layers", "n_layer")
    gpt = getattr(c, "model_type", "") == "gpt2"
    block = _first_block(model, layers)
    head_dim = get("head_dim", default=hidden // heads)
    rope = dict(get("rope_parameters", "rope_scaling", default={}) or {})
    position = _position(model, c)
    theta = rope.get("rope_theta", get("rope_theta", "rotary_emb_base"))
    scaled = rope.get("rope_type", rope.get("type", "default"))
    biases = _biases(block)
    norm, one_plus, norms = _norms(block)
    window, window_layers = _window(c)
    return ModelFacts(
        type(model.model).__name__, "gpt" if gpt else "llama", layers, hidden, heads,
        get("num_key_value_heads", default=heads),
        get("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden,
        get("vocab_size"), seq, bool(get("tie_word_embeddings", default=gpt)), global_batch,
        next(model.parameters()).element_size(), *biases,
        theta if position == "rope" else None,
        scaled if scaled != "default" else None,
        tuple(sorted((k, v) for k, v in rope.items() if k not in ("rope_theta", "rope_type",
                                                                   "type"))),
        get("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon"),
        get("hidden_act", "hidden_activation", "activation_function"), _gated(block),
        head_dim if head_dim != hidden // heads else None,
        get("n_positions", "max_position_embeddings"), position,
        _rotary_fraction(c, rope, head_dim), norm, one_plus, _qk_norm(block, head_dim),
        window, window_layers, _extra(model, c, head_dim, norms),
        _experts(model, c, layers, get), _mla(c))


_QKV = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "query",
        "key", "value", "W_pack")


def _blocks(model, layers: int):
    """The model's list of `layers` blocks (empty if it has none)."""
    import torch.nn as nn
    return next((m for _, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) == layers), [])


def _first_block(model, layers: int):
    blocks = _blocks(model, layers)
    return blocks[0] if len(blocks) else None


def _linears(block):
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D
    return [(n, m) for n, m in block.named_modules() if isinstance(m, (nn.Linear, Conv1D))]


def _in_attention(path: str) -> bool:
    return any(part in ("attn", "attention", "self_attn", "self_attention", "mixer")
               for part in path.split("."))


def _biases(block) -> tuple:
    """(q/k/v, output projection, MLP) have biases, read off the block's linears (Qwen2's q/k/v
    biases are in its code, not its config)."""
    if block is None:
        return None, None, None
    qkv, out, mlp = [], [], []
    for name, m in _linears(block):
        group = (qkv if name.rsplit(".", 1)[-1] in _QKV else out) if _in_attention(name) else mlp
        group.append(m.bias is not None)
    return tuple(any(g) if g else None for g in (qkv, out, mlp))


def _gated(block) -> bool | None:
    """A gated MLP has a gate projection (gate_proj, a fused gate_up_proj: a linear, or the
    experts' own parameter, as transformers 5's fused experts hold it) or three linears. A
    mixture's router is its "gate" too, but gates no MLP: not counted."""
    if block is None:
        return None
    mlp = [n for n, _ in _linears(block) if not _in_attention(n) and n.rsplit(".", 1)[-1] != "gate"]
    fused = [n for n, _ in block.named_parameters() if not _in_attention(n)
             and re.search(r"gate_(up_)?proj", n)]
    return bool(fused) or any("gate" in n for n in mlp) or len(mlp) >= 3


def _experts(model, c, layers: int, get) -> Experts | None:
    """The mixture a config states (Mixtral's, Qwen-MoE's and DeepSeek's names), its MoE
    layers read off the blocks that hold an `experts` module (first_k_dense_replace,
    mlp_only_layers and decoder_sparse_step all say it there)."""
    count = get("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
    if not count:
        return None
    blocks = _blocks(model, layers)
    moe = tuple(any(n.rsplit(".", 1)[-1] == "experts" for n, _ in b.named_modules())
                for b in blocks)
    ffn = get("moe_intermediate_size", "intermediate_size")
    shared = get("shared_expert_intermediate_size")
    if shared is None and get("n_shared_experts"):
        shared = get("n_shared_experts") * ffn
    score = get("scoring_func", default="softmax")
    norm_topk = get("norm_topk_prob", default=True)  # Mixtral always renormalises
    return Experts(count, get("num_experts_per_tok", "moe_topk", default=2), ffn, shared or None,
                   None if all(moe) or not any(moe) else moe, score,
                   score == "softmax" and not norm_topk,
                   float(get("routed_scaling_factor", default=1.0)), get("n_group", default=1),
                   get("topk_group", default=1), get("topk_method") == "noaux_tc")


def _mla(c) -> MLA | None:
    """DeepSeek-V2/V3's latent attention: keys and values from a rank-kv_lora_rank latent."""
    rank = getattr(c, "kv_lora_rank", None)
    if not rank:
        return None
    return MLA(rank, getattr(c, "q_lora_rank", None), c.qk_nope_head_dim, c.qk_rope_head_dim,
               c.v_head_dim)


def _is_norm(module) -> bool:
    return "norm" in type(module).__name__.lower()


def _norms(block) -> tuple[str | None, bool, tuple[str, ...]]:
    """(the kind of the block's norms, whether they scale by 1 + weight, their names): the
    norms outside attention (q/k norms are its own)."""
    if block is None:
        return None, False, ()
    norms = [(n, m) for n, m in block.named_modules() if _is_norm(m) and not _in_attention(n)]
    if not norms:
        return None, False, ()
    module = norms[0][1]
    cls = type(module).__name__
    params = dict(module.named_parameters(recurse=False))
    if "rms" in cls.lower():
        kind = "RMSNorm"
    elif not params:
        kind = "LayerNorm without weight or bias"
    elif params.get("bias") is None:
        kind = "LayerNorm without bias"
    else:
        kind = "LayerNorm"
    return kind, _one_plus(type(module)), tuple(n for n, _ in norms)


def _one_plus(cls) -> bool:
    """Whether the norm multiplies by (1 + weight), as Gemma's does (its weight starts at 0)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return re.search(r"\(\s*1(\.0)?\s*\+\s*self\.weight", source) is not None


_QK_NORM = re.compile(r"(^|[._])(q|k|query|key)_?(norm|layernorm)$")


def _qk_norm(block, head_dim: int) -> str | None:
    """Norms of the queries and keys: each head's ("head", Qwen3) or all heads' ("all", OLMo2)."""
    if block is None:
        return None
    found = [m for n, m in block.named_modules()
             if _is_norm(m) and _in_attention(n) and _QK_NORM.search(n)]
    if not found:
        return None
    weight = getattr(found[0], "weight", None)
    return "all" if weight is not None and weight.numel() != head_dim else "head"


def _position(model, c) -> str:
    import torch.nn as nn
    names = {n.rsplit(".", 1)[-1]: m for n, m in model.named_modules()}
    if any("rotary" in type(m).__name__.lower() for m in names.values()) or \
            getattr(c, "rope_theta", None) is not None and "rotary_emb" in names:
        return "rope"
    if any(isinstance(names.get(n), nn.Embedding)
           for n in ("wpe", "embed_positions", "position_embeddings")):
        return "learned"
    if getattr(c, "alibi", False) or getattr(c, "model_type", "") in ("bloom", "mpt"):
        return "alibi"
    return "none"


def _rotary_fraction(c, rope: dict, head_dim: int) -> float:
    for value in (rope.get("partial_rotary_factor"), getattr(c, "partial_rotary_factor", None),
                  getattr(c, "rotary_pct", None)):
        if value is not None:
            return float(value)
    dim = getattr(c, "rotary_dim", None)
    return dim / head_dim if dim else 1.0


def _window(c) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window and the layers it applies to: layer_types where the config has them,
    else every layer (Mistral, Phi-3), unless use_sliding_window turns it off (older Qwen2)."""
    window = getattr(c, "sliding_window", None)
    if not isinstance(window, int) or getattr(c, "use_sliding_window", True) is False:
        return None, None
    types = getattr(c, "layer_types", None)
    if types is None:
        return window, None
    slides = tuple(t == "sliding_attention" for t in types)
    if not any(slides):
        return None, None
    return window, None if all(slides) else slides


# Config fields that change what a model computes and that no other fact here states:
# (field, its neutral value, what it does)
_SCALINGS = (
    ("attn_logit_softcapping", None, "attention logits soft-capped at {} (tanh)"),
    ("final_logit_softcapping", None, "output logits soft-capped at {} (tanh)"),
    ("embedding_multiplier", 1.0, "embeddings multiplied by {}"),
    ("residual_multiplier", 1.0, "residual branches multiplied by {}"),
    ("attention_multiplier", None, "attention scores scaled by {}"),
    ("logits_scaling", 1.0, "logits divided by {}"),
    ("logit_scale", 1.0, "logits multiplied by {}"),
)


def _extra(model, c, head_dim: int, norms: tuple[str, ...]) -> tuple[str, ...]:
    out = [what.format(getattr(c, field)) for field, neutral, what in _SCALINGS
           if getattr(c, field, None) not in (None, neutral)]
    scalar = getattr(c, "query_pre_attn_scalar", None)
    if scalar is not None and scalar != head_dim:
        out.append(f"attention scores scaled by query_pre_attn_scalar^-1/2 = {scalar}^-1/2, not "
                   f"the head width's {head_dim}^-1/2")
    embed = model.model.get_input_embeddings() if hasattr(model.model, "get_input_embeddings") \
        else None
    if getattr(embed, "embed_scale", None) is not None:
        out.append("token embeddings scaled by sqrt(hidden)")
    if len(norms) > 2 or any("post_feedforward" in n for n in norms):
        out.append(f"{len(norms)} norms per layer ({', '.join(norms)}): norms on the attention's "
                   f"and the MLP's outputs too")
    if any(n.endswith("shared_expert_gate") for n, _ in model.named_modules()):
        out.append("the shared expert's output scaled by a sigmoid gate (shared_expert_gate)")
    if getattr(c, "use_parallel_residual", False) or getattr(c, "parallel_attn", False) or \
            getattr(c, "model_type", "") in ("gptj", "phi", "cohere", "cohere2"):
        out.append("attention and MLP in parallel from one norm (a parallel block)")
    return tuple(out)
