"""Rotary embeddings whose frequencies transformers recomputes in forward, fixed for one length.

transformers' `dynamic_rope_update` (rope types "dynamic" and "longrope") sets a rotary
embedding's `inv_freq` from the largest position id of each call: longrope copies in the
frequencies of its long factors past `original_max_position_embeddings` (else its short ones),
dynamic NTK rescales its base past `max_position_embeddings`. HFCausalLM's positions are 0..seq-1
in every sample, so the frequencies are those of seq alone, the same on every rank and
micro-batch. Traced as written, though, the update is a write into a buffer (refused at capture:
passes.capture.unsupported) or a branch on a tensor's value (torch.export fails), and it reads the
positions, of which context parallelism gives each rank a part (a rank holding early tokens only
would take the short factors).

`at_length(model, seq)` gives each such embedding, while forward runs, the frequencies
transformers' own update leaves at seq positions, by transformers' own functions from the config
alone, and switches the update off through the rope type the decorator reads. Outside it the
model is as transformers built it. Every value the graph reads keeps its value on a meta model
(planner.weights.materialize): longrope's long frequencies are a buffer (`prepare`), dynamic NTK's
length arithmetic runs on CPU scalars.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

# A rope type dynamic_rope_update leaves alone: it contains no "dynamic" and is not "longrope".
_FIXED = "fxpar_fixed_length"
_ABSENT = object()


class LongFactors(torch.nn.Module):
    """The frequencies of a longrope embedding's long factors, as transformers computes them on
    first use, in a buffer: computed in the graph, their factors would be a constant without
    values on a meta model; a module of its own, so materialisation builds it again from `cfg`
    ((config, layer type or None))."""

    def __init__(self, cfg: tuple):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        self.cfg = cfg
        config, layer_type = cfg
        # transformers computes them at limit + 1 (any length past the limit gives the long set)
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](
            config, None, seq_len=_limit(config, layer_type) + 1, layer_type=layer_type)
        self.inv_freq = torch.nn.Buffer(inv_freq, persistent=False)


def prepare(model: torch.nn.Module) -> None:
    """Give each longrope embedding of `model` its long frequencies (LongFactors), on the
    device the model is being built on; idempotent."""
    for module in list(model.modules()):
        for layer, kind in _kinds(module).items():
            if kind == "longrope" and not hasattr(module, _long_name(layer)):
                module.add_module(_long_name(layer), LongFactors((module.config, layer)))


def _long_name(layer_type: str | None) -> str:
    return f"fxpar_{layer_type}_long_factors" if layer_type else "fxpar_long_factors"


def _limit(config, layer_type: str | None) -> int:
    params = config.rope_parameters
    return (params[layer_type] if layer_type else params)["original_max_position_embeddings"]


def _updates(rope_type) -> bool:
    """Whether dynamic_rope_update recomputes the frequencies of this rope type (its own test)."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def _kinds(module: torch.nn.Module) -> dict[str | None, str]:
    """{layer type (None: the module's only one): rope type} of the frequencies transformers
    updates in this module's forward; empty for any other module."""
    if getattr(getattr(type(module), "forward", None), "__code__", None) is not _wrapper_code():
        return {}
    rope_type = getattr(module, "rope_type", None)
    kinds = rope_type if isinstance(rope_type, dict) else {None: rope_type}
    return {layer: kind for layer, kind in kinds.items() if _updates(kind)}


@functools.cache
def _wrapper_code():
    """The code of dynamic_rope_update's wrapper: the same for every forward it decorates."""
    from transformers.modeling_rope_utils import dynamic_rope_update
    return dynamic_rope_update(lambda *args, **kwargs: None).__code__


def frequencies(module: torch.nn.Module, layer_type: str | None, rope_type: str,
                seq: int) -> tuple[torch.Tensor, float | None]:
    """(inv_freq, attention scaling or None: unchanged) that transformers' update leaves in a
    newly built `module` after a forward over positions 0..seq-1."""
    prefix = f"{layer_type}_" if layer_type else ""
    current = module._buffers[f"{prefix}inv_freq"]
    original = getattr(module, f"{prefix}original_inv_freq")
    if rope_type == "longrope":  # copied into the buffer: in its dtype
        if seq <= _limit(module.config, layer_type):
            return original.to(current.dtype), None
        return getattr(module, _long_name(layer_type)).inv_freq.to(current.dtype), None
    if seq <= module.original_max_seq_len:  # no growth past the built length: as built
        return original.to(current.dtype), None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    # transformers passes the length as a tensor (largest position + 1): the same arithmetic,
    # on CPU scalars, whose constants keep their values on a meta model
    length = torch.full((), seq, dtype=torch.long, device="cpu")
    return ROPE_INIT_FUNCTIONS[rope_type](module.config, original.device, seq_len=length,
                                          layer_type=layer_type)


@contextlib.contextmanager
def at_length(model: torch.nn.Module, seq) -> Iterator[None]:
    """Inside: every rotary embedding of `model` that transformers updates in forward holds the
    frequencies of `seq` positions and does not update them. A `seq` that is no int (the
    fx.Proxy of symbolic_trace, which cannot follow transformers anyway) changes nothing."""
    saved: list[tuple[torch.nn.Module, dict]] = []
    try:
        for module in model.modules() if isinstance(seq, int) else ():
            kinds = _kinds(module)
            if kinds:
                saved.append((module, _fix(module, kinds, seq)))
        yield
    finally:
        for module, before in reversed(saved):
            _restore(module, before)


def _fix(module: torch.nn.Module, kinds: dict, seq: int) -> dict:
    """Set the frequencies of `seq` and a rope type without updates; returns what was there.
    All are computed before any is set, so a failure leaves the module as it was."""
    values = {layer: frequencies(module, layer, kind, seq) for layer, kind in kinds.items()}
    before = {"rope_type": module.rope_type, "buffers": {},
              "attention_scaling": module.__dict__.get("attention_scaling", _ABSENT)}
    for layer, (inv_freq, scaling) in values.items():
        key = f"{layer}_inv_freq" if layer else "inv_freq"
        before["buffers"][key] = module._buffers[key]
        # in the buffer's place while forward runs, so the graph reads this value, unwritten
        module._buffers[key] = inv_freq
        if scaling is not None:  # dynamic NTK's update sets it (to 1.0), as transformers does
            module.attention_scaling = scaling
    rope_type = module.rope_type
    module.rope_type = ({k: _FIXED if k in kinds else v for k, v in rope_type.items()}
                        if isinstance(rope_type, dict) else _FIXED)
    return before


def _restore(module: torch.nn.Module, before: dict) -> None:
    module.rope_type = before["rope_type"]
    module._buffers.update(before["buffers"])
    if before["attention_scaling"] is _ABSENT:
        module.__dict__.pop("attention_scaling", None)
    else:
        module.attention_scaling = before["attention_scaling"]
