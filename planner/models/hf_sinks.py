"""Fused attention with sinks for Hugging Face models whose attention has them (GPT-OSS).

transformers' gpt_oss has no SDPA attention (a learned logit per head, `sinks`, joins each
row's softmax and is then dropped, which SDPA cannot express), so captured eagerly it writes
the [b, heads, s, s + 1] scores out and runs every sliding-window layer as full causal
attention. Under the name "fxpar_sinks" this module registers

  * an attention function that runs runtime.attention.sinks' op, `torch.ops.fxpar.sink_attention`
    (transformers' eager math exactly: GQA repeat, causal mask, sliding window of
    `module.sliding_window` keys, sinks), as one node, and
  * a mask function that builds no mask where the op applies the mask itself: the plain causal
    mask, and the sliding-window causal mask of the config's window, over all tokens (no
    padding, no offsets; packed-sequence parts dropped only inside
    planner.models.hf_attention.plain_positions, as for "fxpar_sdpa").

Any other mask (padding, packed sequences, a cache's offsets, a 4-D mask given by the caller)
is built as transformers' eager mask and run by transformers' own eager attention, so it is
honoured exactly, never dropped; only that attention is then written out op by op.
"""
from __future__ import annotations

from planner.models.hf_attention import _free, _parts

NAME = "fxpar_sinks"
MODEL_TYPES = frozenset({"gpt_oss"})   # transformers models whose attention takes sinks (s_aux)


def register() -> str:
    """Register the attention and mask functions (idempotent); returns their name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(NAME, sink_attention_forward)
    AttentionMaskInterface.register(NAME, causal_or_eager_mask)
    return NAME


def sink_attention_forward(module, query, key, value, attention_mask, scaling=None,
                           dropout=0.0, sliding_window=None, s_aux=None, **kwargs):
    """transformers' AttentionInterface signature; (output [b, s, heads, head_dim], None)."""
    from runtime.attention.sinks import sink_attention
    if attention_mask is not None:  # a mask the op does not apply itself: eager, exactly
        return _eager(module, query, key, value, attention_mask, scaling, dropout)
    if dropout:
        raise ValueError(f"fxpar's attention with sinks has no attention dropout (got "
                         f"{dropout}); set the config's attention_dropout to 0")
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if sinks is None:
        raise ValueError(f"{type(module).__name__} has no attention sinks (s_aux or .sinks); "
                         f"attention {NAME!r} is for models that have them: build this one "
                         f"with attn_implementation 'sdpa' or 'eager'")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # The mask function dropped the layer's mask only if it was the causal or the config's
    # sliding-window one; the layer's own window (None on full layers) says which.
    out = sink_attention(query, key, value, sinks, float(scaling), int(sliding_window or 0))
    return out.transpose(1, 2).contiguous(), None


def _eager(module, query, key, value, attention_mask, scaling, dropout):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                   dropout=dropout)


def causal_or_eager_mask(*args, mask_function=None, attention_mask=None, **kwargs):
    """None where the op applies the mask itself (module docstring); else transformers' eager
    mask (additive, 0 and the dtype's minimum)."""
    from transformers.masking_utils import causal_mask_function, eager_mask
    mask_function = mask_function if mask_function is not None else causal_mask_function
    if attention_mask is None and _plain(mask_function, kwargs):
        return None
    return eager_mask(*args, mask_function=mask_function, attention_mask=attention_mask,
                      **kwargs)


def _plain(mask_function, kwargs: dict) -> bool:
    """The causal mask, or the causal mask within the config's sliding window, of a sequence
    attending to itself from position 0."""
    from transformers.masking_utils import causal_mask_function
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if not (kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
            and q_length is not None and q_length == kv_length):
        return False
    parts = _parts(mask_function)
    if causal_mask_function not in parts:
        return False
    others = [p for p in parts if p is not causal_mask_function]
    if not others:
        return True
    window = getattr(kwargs.get("config"), "sliding_window", None)
    return (len(others) == 1 and window is not None
            and getattr(others[0], "__qualname__", "").startswith("sliding_window_overlay.")
            and _free(others[0], "sliding_window") == window)
