"""What a failed capture says: where in the user's code it failed (the module and the line of
their own source, never torch's wrappers), what kind of failure it is, and what to change, with
torch's pointers to its debugging tools cut away and its internal reasoning about symbols left out
where the kind already says it (a data-dependent branch or size)."""
from __future__ import annotations

import contextlib
import linecache
import logging
import os
import traceback

import torch
import torch.fx as fx

TORCH_DIR = os.path.dirname(torch.__file__)
# torch's loggers that print, during a capture that then fails or succeeds, lines meant for
# torch's own debugging ("Unable to find user code corresponding to {u0}")
_CHATTY = ("torch.fx.experimental.symbolic_shapes", "torch._export.non_strict_utils")
# Where torch's own messages turn to its debugging tools or its docs: cut there (torch.fx's
# TraceError explains, after its first sentence, where proxies get iterated in general)
_TORCH_NOISE = ("Original traceback:", "Use tlparse", "For more information",
                "(https://", "Set TORCH_LOGS", "from user code:", "See the torch.fx docs",
                "This can be attempted when the Proxy")
DATA_DEPENDENT = ("a tensor's values decide a shape or a branch there (.item(), .tolist(), "
                  "nonzero, boolean-mask indexing, torch.unique, `if` on a tensor); fxpar "
                  "captures on fake tensors, so compute such sizes from the config or the inputs' "
                  "shapes (e.g. a fixed capacity per expert, a mask multiplied in instead of "
                  "indexed with, a branch on a config value)")


@contextlib.contextmanager
def quiet_torch():
    """torch's capture-time warnings off: what fails is said once, by fxpar's error."""
    loggers = [logging.getLogger(name) for name in _CHATTY]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def clean(message: str) -> str:
    """A torch error's first sentence, without the pointers to torch's debugging tools."""
    line = " ".join(message.split())
    for noise in _TORCH_NOISE:
        line = line.split(noise)[0]
    line = line.strip(" .:") or "(no message)"
    return line if len(line) <= 300 else line[:299] + "…"


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {clean(str(err))}"


def data_dependent(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}"
    return "DataDependent" in text or "data-dependent" in text or "_local_scalar_dense" in text


def hint(err: BaseException) -> str:
    """What to change, by the kind of failure."""
    text = f"{type(err).__name__} {err}"
    if data_dependent(err):
        return DATA_DEPENDENT
    if "more than 1 value per channel when training" in text:
        return ("fxpar captures the model with one sample of the example batch, and a layer "
                "that needs more than one sample in training mode (batch statistics, as "
                "BatchNorm's) fails on it; batch statistics would be those of each micro-batch "
                "on each data-parallel rank under fxpar, not the global batch's, so such a "
                "layer is not trained: use LayerNorm or GroupNorm, or freeze its statistics "
                "(eval mode)")
    if "Guard" in text or "Unsupported" in text or "control flow" in text:
        return ("a Python branch or call there cannot be traced: keep control flow on sizes "
                "and config values, not on tensor values")
    return ("check that the example inputs have the shapes and dtypes forward expects (the "
            "global batch on dim 0; fxpar captures with one sample)")


def _owner(frame) -> object | None:
    """The module a frame's method runs on (its first argument, whatever it is called, where
    the function is one of that object's class's own), else None."""
    code = frame.f_code
    owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    for cls in type(owner).__mro__:
        if getattr(cls.__dict__.get(code.co_name), "__code__", None) is code:
            return owner
    return None


def user_frame(err: BaseException, root: torch.nn.Module) -> tuple[str | None, str | None]:
    """(module name, "`source line` (file:line)") of the innermost frame of the user's own code
    (outside torch) that runs in one of root's modules; Nones where there is none."""
    names = {id(m): name or type(root).__name__ for name, m in root.named_modules()}
    module = where = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if frame.f_code.co_filename.startswith(TORCH_DIR):
            continue
        owner = _owner(frame)
        if id(owner) in names:
            module = names[id(owner)]
            line = linecache.getline(frame.f_code.co_filename, lineno).strip()
            where = (f"`{line}` " if line else "") + \
                f"({os.path.basename(frame.f_code.co_filename)}:{lineno})"
    return module, where


def where(err: BaseException, root: torch.nn.Module, limit: int = 0) -> str:
    """'in module X, at `line` (file:n), Error: msg', the message left out for a data-dependent
    failure (its kind is said by `hint`, its symbols mean nothing to the user)."""
    module, at = user_frame(err, root)
    message = "" if data_dependent(err) else (clean(str(err)) if str(err) else "")
    if limit and len(message) > limit:
        message = message[:limit].rstrip() + "…"
    parts = [f"in module '{module}'" if module else None, f"at {at}" if at else None,
             f"{type(err).__name__}" + (f": {message}" if message else "")]
    return ", ".join(p for p in parts if p)


def node_where(node: fx.Node, module_paths) -> str:
    """"at node X (target) in module 'a.b', from `source line`"."""
    paths = module_paths(node)
    target = getattr(node.target, "__name__", None) or str(node.target)
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = trace[-1].strip() if trace else ""
    return (f"at node {node.name} ({target}) in module '{paths[-1] if paths else '<root>'}'"
            + (f", from `{line}`" if line else ""))


def export_failure(model: torch.nn.Module, err: BaseException, trace_error: BaseException) -> str:
    """Why neither capture worked: torch.export's failure first (the capture this model needs);
    symbolic_trace's too, unless it failed at the same line for the same reason."""
    said = f"cannot capture {type(model).__name__}: torch.export failed ({where(err, model, 140)})"
    at = user_frame(err, model)
    if data_dependent(err) and at[1] is not None and user_frame(trace_error, model) == at:
        return f"{said}; {hint(err)}"
    return (f"{said}; {hint(err)} (torch.fx.symbolic_trace failed too: "
            f"{where(trace_error, model, 100)})")
