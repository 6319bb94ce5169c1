"""A causal attention that stays `is_causal` when a Hugging Face model is captured.

transformers builds a full [batch, 1, seq, seq] causal mask whenever it is traced or exported
(it cannot prove at trace time that no token is padded), so the captured attention carries an
explicit mask that context parallelism cannot ring around. Under the name "fxpar_sdpa" this
module registers transformers' own SDPA attention together with a mask function that, for the
plain causal mask and no padding mask, builds no mask at all: SDPA then runs with
`is_causal=True`, which is the same attention. Every other mask (sliding windows, padding,
packed sequences) is built exactly as transformers' SDPA mask builds it. A traced model always
gets a packed-sequence mask (transformers cannot read the positions while tracing); inside
`plain_positions()` (a forward given no position ids) it is known to keep every pair.

Only architectures that offer SDPA use it (Gemma 2's soft-capped scores and the ALiBi models
need their eager attention; GPT-OSS's attention sinks have their own fused op,
planner.models.hf_sinks).
"""
from __future__ import annotations

import contextlib

NAME = "fxpar_sdpa"


def register() -> str:
    """Register the attention and mask functions (idempotent); returns their name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, causal_or_sdpa_mask)
    return NAME


_PLAIN = {"positions": False}  # set while a forward runs whose positions are 0..seq-1


@contextlib.contextmanager
def plain_positions():
    """Inside: the model's positions are 0, 1, ... in every sample (no packed sequences), so
    the packed-sequence mask transformers adds when it is traced (it cannot look at the
    positions then) keeps every pair and may be left out."""
    before, _PLAIN["positions"] = _PLAIN["positions"], True
    try:
        yield
    finally:
        _PLAIN["positions"] = before


def causal_or_sdpa_mask(*args, mask_function=None, attention_mask=None, **kwargs):
    """None (SDPA's is_causal) for the plain causal mask over all tokens; else the SDPA mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    mask_function = mask_function if mask_function is not None else causal_mask_function
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    plain = (attention_mask is None and _parts(mask_function) == [causal_mask_function]
             and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
             and q_length is not None and q_length == kv_length)
    if plain:
        return None
    return sdpa_mask(*args, mask_function=mask_function, attention_mask=attention_mask,
                     **kwargs)


def _parts(mask_function) -> list:
    """The mask functions `mask_function` intersects (transformers' and_masks), less the
    packed-sequence ones where positions are plain; [mask_function] when it is no intersection
    (or one of a form not recognised: it is then built as a mask, never dropped)."""
    name = getattr(mask_function, "__qualname__", "")
    if _PLAIN["positions"] and name.startswith("remap_positions_for_packed_sequence."):
        inner = _free(mask_function, "mask_function")  # positions 0..seq-1: remapped as is
        return [mask_function] if inner is None else _parts(inner)
    inner = _free(mask_function, "mask_functions") if name.startswith("and_masks.") else None
    if inner is None:
        return [mask_function]
    parts = [p for f in inner for p in _parts(f)]
    if _PLAIN["positions"]:
        parts = [p for p in parts if not getattr(p, "__qualname__", "").startswith(
            "packed_sequence_mask_function.")]
    return parts


def _free(function, name: str):
    """The value of the free variable `name` of a closure; None when it has none of that name."""
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars or function.__closure__ is None:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents
