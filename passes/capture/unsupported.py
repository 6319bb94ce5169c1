"""What a model may do in forward that fxpar cannot train as one process does, found at capture.

fxpar runs forward once per micro-batch on every data-parallel rank (and again where it
recomputes a layer), and carries values between pipeline stages as tensors. So:

  - a BatchNorm layer that normalises with batch statistics sees one micro-batch on one rank,
    not the global batch (SyncBatchNorm-like semantics are not implemented);
  - a parameter or buffer that forward updates (a counter, an EMA, running statistics) is
    updated once per micro-batch on each rank: the ranks' copies drift apart;
  - a result of forward besides the loss that is not a tensor (`tokens.shape[0]`) cannot leave
    its pipeline stage.

Each check returns the one-line reason (trace.capture raises it as a CaptureError; this module
does not import trace, which imports it), naming the module or buffer and the source line.

`untouched` also repairs what symbolic_trace does to the model: where forward assigns an
attribute (`self.seen += n`, `self.last = x`), the trace assigns the traced value (an fx.Proxy)
to the user's module, which would keep it after the capture.
"""
from __future__ import annotations

import contextlib
import operator
import os
import re
import warnings
from typing import Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase


def batch_statistics(model: torch.nn.Module) -> str | None:
    """Why a normalisation layer of `model` cannot train under fxpar, or None: one that
    normalises with the batch's statistics, or one that updates running statistics."""
    for name, module in model.named_modules():
        if not isinstance(module, _NormBase):
            continue
        kind = type(module).__name__
        if isinstance(module, _BatchNorm) and (module.training or module.running_mean is None):
            return (f"{name} ({kind}) normalises with the statistics of the batch it is given: "
                    f"fxpar gives it one micro-batch on each data-parallel rank, not the global "
                    f"batch, so training would not match one process; use LayerNorm or "
                    f"GroupNorm, or freeze its statistics ({name}.eval())")
        if module.training and module.track_running_stats:  # InstanceNorm's running stats
            return (f"{name} ({kind}) updates its running statistics in forward, once per "
                    f"micro-batch on each data-parallel rank under fxpar, unlike one process; "
                    f"construct it with track_running_stats=False, or freeze it ({name}.eval())")
    return None


# batch_norm as symbolic_trace and torch.export record it: `training` is argument 5 of each
_BATCH_NORMS = {F.batch_norm, torch.batch_norm, torch.ops.aten.batch_norm.default,
                torch.ops.aten.native_batch_norm.default,
                torch.ops.aten._native_batch_norm_legit.default,
                torch.ops.aten._native_batch_norm_legit_functional.default}


def functional_batch_norm(gm: fx.GraphModule, model: torch.nn.Module) -> str | None:
    """`batch_statistics` for a batch_norm the model calls itself (F.batch_norm(...,
    training=True)), found in the graph."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BATCH_NORMS:
            training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
            if training is True:
                line = source_line(node, model)
                return (f"{type(model).__name__}.forward normalises with batch statistics "
                        f"({node.name}{', ' + line if line else ''}): fxpar gives it one "
                        f"micro-batch on each data-parallel rank, not the global batch, so "
                        f"training would not match one process; use LayerNorm or GroupNorm, or "
                        f"running statistics (training=False)")
    return None


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[list[tuple[str, str | None, bool]]]:
    """Put back every attribute of the model's modules that a trace inside the block set to a
    traced value. Yields a list that then holds (module.attribute, node name, is a buffer) of
    each, and (buffer, None, True) of each buffer written into while tracing (symbolic_trace
    reads buffers as real tensors: `self.ema.mul_(0.9)` runs on the model's own, not in the
    graph). A buffer is then refused (`state_updates`), another attribute warned of."""
    before = [(name, m, dict(m.__dict__), dict(m._buffers)) for name, m in model.named_modules()]
    versions = {id(b): b._version for b in model.buffers() if b is not None}
    written: list[tuple[str, str | None, bool]] = []
    try:
        yield written
    finally:
        for name, module, attrs, buffers in before:
            for store, old in ((module._buffers, buffers), (module.__dict__, attrs)):
                for key, value in list(store.items()):
                    if not isinstance(value, fx.Proxy):
                        continue
                    written.append((f"{name}.{key}" if name else key, value.node.name,
                                    store is module._buffers))
                    if key in old:
                        store[key] = old[key]
                    else:
                        del store[key]
        written += [(f"{name}.{key}" if name else key, None, True) for name, module, _, _ in before
                    for key, b in module._buffers.items() if b is not None
                    and id(b) in versions and b._version != versions[id(b)]]


def state_updates(gm: fx.GraphModule, model: torch.nn.Module,
                  written: list[tuple[str, str, bool]]) -> str | None:
    """Why forward's updates of its parameters or buffers cannot train under fxpar, or None.
    `written`: what `untouched` put back after the trace of `gm`."""
    states = {n: "parameter" for n, _ in gm.named_parameters(remove_duplicate=False)}
    states.update({n: "buffer" for n, _ in gm.named_buffers(remove_duplicate=False)})
    found = [(states[str(root.target)], str(root.target), writer)
             for root, writer in _writes(gm)
             if root.op == "get_attr" and str(root.target) in states]
    nodes = {n.name: n for n in gm.graph.nodes}
    found += [("buffer", attr, nodes.get(node) if node else None)
              for attr, node, is_buffer in written if is_buffer]
    attributes = [attr for attr, _, is_buffer in written if not is_buffer]
    if attributes:
        warnings.warn(f"{type(model).__name__}.forward sets {', '.join(attributes)} to computed "
                      f"values: fxpar trains the captured graph, which does not set them (they "
                      f"keep their values from before the capture)", stacklevel=3)
    if not found:
        return None
    kind, name, writer = found[0]
    line = source_line(writer, model) if writer is not None else ""
    op = f"{_op_name(writer)}, " if writer is not None else ""
    return (f"{type(model).__name__}.forward updates {kind} '{name}' ({op}{line or 'in forward'}): "
            f"fxpar runs forward once per micro-batch on every data-parallel rank (and again "
            f"where it recomputes a layer), so the {kind} would not take the values it takes in "
            f"one process; update it outside forward (after train_step), or leave it out")


def non_tensor_output(gm: fx.GraphModule, model: torch.nn.Module) -> str | None:
    """Why forward's results cannot leave the pipeline's stages, or None: one (besides the loss,
    which check_loss covers) that is not a tensor."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    for i, value in enumerate(outputs[1:], start=1):
        nodes: list[fx.Node] = []
        fx.node.map_arg(value, nodes.append)
        for node in nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                continue
            line = source_line(node, model)
            return (f"{type(model).__name__}.forward returns {_kind(val)} as result {i} "
                    f"({node.name}{', ' + line if line else ''}): fxpar carries forward's results "
                    f"between pipeline stages as tensors, and train_step returns the loss alone; "
                    f"return the loss (and tensors only), and compute that value from the batch "
                    f"outside the model")
    return None


def _kind(val) -> str:
    if val is None:
        return "a value that is not a tensor"
    name = type(val).__name__
    return f"an {name}" if name[0] in "aeiouAEIOU" else f"a {name}"


# GraphModule.meta key: the concrete_args symbolic_trace was given (forward's defaults)
CONCRETE_ARGS = "fxpar_concrete_args"


# What a write into a value writes into: the tensor it was taken from (views, in-place results)
_VIEW_METHODS = {"view", "view_as", "reshape", "transpose", "permute", "select", "narrow",
                 "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "t", "detach",
                 "diagonal", "as_strided", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, getattr, torch.reshape, torch.transpose, torch.permute,
                   torch.select, torch.narrow, torch.squeeze, torch.unsqueeze, torch.flatten,
                   torch.detach, torch.diagonal}


def _in_place(node: fx.Node) -> bool:
    """Whether the node writes into its first argument."""
    if node.kwargs.get("inplace") is True:  # F.relu(x, inplace=True) & co.
        return True
    if node.op == "call_method":
        return node.target == "__setitem__" or (
            node.target.endswith("_") and not node.target.startswith("_"))
    if node.op != "call_function":
        return False
    if node.target is operator.setitem:
        return True
    schema = getattr(node.target, "_schema", None)  # an aten op (export graphs)
    if schema is not None:
        info = schema.arguments[0].alias_info if schema.arguments else None
        return info is not None and info.is_write
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")  # torch.relu_, Tensor.add_


def _view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.arguments) and schema.arguments[0].alias_info is not None
    return node.target in _VIEW_FUNCTIONS


def _root(node) -> fx.Node | None:
    """The placeholder or get_attr whose memory `node` is (through views and in-place ops)."""
    while isinstance(node, fx.Node):
        if node.op in ("get_attr", "placeholder"):
            return node
        if not (node.args and (_in_place(node) or _view(node))):
            return None
        node = node.args[0]
    return None


def _writes(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(root written into, writing node) of every in-place write in the graph, in order; a
    write inside a subgraph an op calls (export's `wrap_with_set_grad_enabled(False, submod,
    *args)` for a `torch.no_grad()` block) is traced back to the argument it writes."""
    found = []
    for node in gm.graph.nodes:
        if _in_place(node) and node.args:
            root = _root(node.args[0])
            if root is not None:
                found.append((root, node))
        subs = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and
                a.op == "get_attr" and isinstance(_attr(gm, a.target), fx.GraphModule)]
        if node.op == "call_function" and subs:
            sub = _attr(gm, node.args[subs[0]].target)
            operands = node.args[subs[0] + 1:]
            inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for root, writer in _writes(sub):
                if root.op == "placeholder" and root in inputs and \
                        inputs.index(root) < len(operands):
                    outer = _root(operands[inputs.index(root)])
                    if outer is not None:
                        found.append((outer, writer))
    return found


def _attr(gm: torch.nn.Module, target: str):
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target))


def source_line(node: fx.Node, model: torch.nn.Module) -> str:
    """"file:line `code`" of the model's source that made `node`: from its stack trace
    (torch.export records one), or else from the same trace made again with stack traces
    (symbolic_trace records none by default; only this error path pays for them)."""
    stack = node.meta.get("stack_trace")
    if not stack:
        tracer = fx.Tracer()
        tracer.record_stack_traces = True
        owner = node.graph.owning_module
        concrete = getattr(owner, "meta", {}).get(CONCRETE_ARGS)  # as first traced
        try:
            with untouched(model):
                graph = tracer.trace(model, concrete_args=concrete)
        except Exception:  # noqa: BLE001 - the line is extra: the message stands without it
            return ""
        again = next((n for n in graph.nodes if n.name == node.name), None)
        stack = again.meta.get("stack_trace") if again is not None else None
    return _user_frame(stack or "")


_TORCH_DIR = os.path.dirname(torch.__file__)


def _user_frame(stack: str) -> str:
    """The innermost frame of a stack trace outside torch, as "file:line `code`"."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', stack)
    for path, line, code in reversed(frames):
        if not os.path.abspath(path).startswith(_TORCH_DIR):
            return f"{os.path.basename(path)}:{line} `{code.strip()}`"
    return ""
