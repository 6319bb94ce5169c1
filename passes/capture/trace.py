"""Capture a model as an FX graph with a shape on every tensor node, grouped into layers.

`torch.fx.symbolic_trace` is tried first (it keeps `nn.Linear` & co. as call_module nodes, which the
rewrite passes handle directly); when it cannot trace, `torch.export` is used (its graph is FX too).
Shapes come from FakeTensorProp, so a model on the meta device is captured without allocating weights.

Layers: the largest outermost `nn.ModuleList` (or `nn.Sequential` of blocks) is the list of
repeated blocks (its children need not be alike: passes.capture.block_runs groups them into runs
of identical blocks); each block is one layer, everything before the first block is the "embed"
layer and everything after the last one the "head" layer. A model of several parts - a vision
tower's layers then a decoder's, an encoder's then a decoder's - has several outermost lists of
blocks that run one after the other: each is a part, and their blocks make one chain in the
order they run ("embed", "encoder.block.0", ..., "decoder.block.0", ..., "head"). A node between
blocks that reads a block's output goes with the block that ran last before it (a projector
after the vision tower), one that reads none with "embed" (a decoder's token embedding), whose
value crosses the stages in between to its users.

Every node computed from no input and no trained parameter (position tables, BLOOM's ALiBi bias,
masks from aranges) carries node.meta[CONSTANT] = True, which a layer cut out of the graph still
reads on its placeholders: a rewrite may slice such a value per rank without a gradient to sum.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import re
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes.capture import unsupported
from passes.capture.fused_slices import slices_to_splits
from passes.capture.linear_forms import products_to_linears
from passes.capture.size_copies import copy_size_reads
from passes.capture.capture_errors import (data_dependent, export_failure, first_line, hint,
                                           node_where, quiet_torch, where)

CONSTANT = "fxpar_constant"


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the module and the operation."""


@dataclass(frozen=True)
class Layer:
    name: str            # "embed", "blocks.3", "head"
    index: int           # position in the chain
    kind: str            # "embed" | "block" | "head"
    nodes: tuple[str, ...]
    signature: str       # equal for structurally identical blocks (same ops, same shapes)


@dataclass
class Captured:
    gm: fx.GraphModule
    layers: tuple[Layer, ...]
    layer_graph: nx.DiGraph     # layers as nodes; an edge carries the bytes of the tensors crossing it
    input_names: tuple[str, ...]
    method: str                 # "symbolic_trace" or "export"
    batch: int = 1              # samples in the example inputs (dim 0): every shape is at this size
    seq: int = 1                # their dim 1 (tokens per sample), when they have one
    tied: tuple[tuple[str, ...], ...] = ()  # names of one parameter used in several places
    parts: tuple[str, ...] = ()  # the block lists split into stages, in the order they run

    def layer_of(self) -> dict[str, str]:
        return {n: layer.name for layer in self.layers for n in layer.nodes}

    @property
    def blocks(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "block")


# torch.nn modules that symbolic_trace keeps as single calls (leaves) though they hold linears
# and attention: torch.export traces them into the ops the cost model and the rewrites know
_FUSED_MODULES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                  torch.nn.TransformerDecoderLayer)


def capture(model: torch.nn.Module, example_inputs: tuple,
            parts: tuple[str, ...] | None = None) -> Captured:
    """Trace `model` and propagate fake shapes of `example_inputs` through it. `parts` (or the
    model's `fxpar_parts` attribute) names the lists of blocks to split into stages, overriding
    the lists found (`block_lists`): a list left out runs inside the layer around it."""
    parts = parts or getattr(model, "fxpar_parts", None)
    lists = _named_lists(model, tuple(parts)) if parts else block_lists(model)
    fused = next((m for m in model.modules() if isinstance(m, _FUSED_MODULES)), None)
    _refuse(unsupported.batch_statistics(model))
    written: list = []
    try:
        if fused is not None:  # symbolic_trace keeps them whole (leaves no rule prices)
            raise CaptureError(f"{type(fused).__name__} is traced into its ops by torch.export")
        with unsupported.untouched(model) as written:  # what the trace wrote into the model
            gm, method = _symbolic_trace(model, len(example_inputs)), "symbolic_trace"
    except Exception as trace_error:  # noqa: BLE001 - fall back to export, report both if it fails
        gm, method, written = _export(model, example_inputs, trace_error), "export", []
    _refuse(unsupported.state_updates(gm, model, written))
    _refuse(unsupported.functional_batch_norm(gm, model))
    products_to_linears(gm)  # Falcon's `x @ w.T`: the linear that tensor parallelism splits
    propagate_shapes(gm, example_inputs)
    slices_to_splits(gm)  # Phi-3's slices of a fused projection: one split, cut per part
    loss_first(gm)
    check_loss(gm, model)
    _refuse(unsupported.non_tensor_output(gm, model))
    mark_constants(gm)
    parts = _parts(gm, lists)
    layers = _read_sizes_where_used(gm, _group_layers(gm, parts))
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
    batch = int(first.shape[0]) if first is not None and first.dim() else 1
    seq = int(first.shape[1]) if first is not None and first.dim() > 1 else 1
    return Captured(gm, layers, _layer_graph(gm, layers), inputs, method, batch, seq,
                    tied_parameters(model), parts)


def _symbolic_trace(model: torch.nn.Module, given: int) -> fx.GraphModule:
    """fx.symbolic_trace with forward's parameters past the `given` inputs at their defaults
    (`causal: bool = True`), as calling forward without them runs: traced as constants, with
    their placeholders (and the checks fx adds that a caller passes the same value) removed, so
    that the graph's inputs are the batch's."""
    defaults = _defaults_after(model, given)
    gm = fx.symbolic_trace(model, concrete_args=defaults or None)
    gm.meta[unsupported.CONCRETE_ARGS] = defaults or None  # to trace it again alike
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"][given:]:
        if node.args:  # a default, now a constant: nothing reads this input but fx's check
            _erase_with_users(gm.graph, node)
    gm.recompile()
    return gm


def _defaults_after(model: torch.nn.Module, given: int) -> dict:
    """forward's positional parameters after the first `given`, with their plain defaults."""
    try:
        params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    plain = (bool, int, float, str, type(None))
    return {p.name: p.default for p in params[given:]
            if p.kind == p.POSITIONAL_OR_KEYWORD and isinstance(p.default, plain)}


def _erase_with_users(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and every node computed from it, unless the output is among them."""
    doomed = {node}
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in doomed:
                doomed.add(user)
                stack.append(user)
    if any(n.op == "output" for n in doomed):
        return
    for n in reversed([n for n in graph.nodes if n in doomed]):
        graph.erase_node(n)


def _refuse(why: str | None) -> None:
    if why:
        raise CaptureError(why)


def mark_constants(gm: fx.GraphModule) -> None:
    """node.meta[CONSTANT] on the nodes computed from no placeholder and no trained parameter."""
    constant: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            prefix, _, name = str(node.target).rpartition(".")
            value = getattr(gm.get_submodule(prefix) if prefix else gm, name, None)
            if not (isinstance(value, torch.nn.Parameter) and value.requires_grad):
                constant.add(node)
        elif node.op in ("call_function", "call_method") and all(
                a in constant for a in node.all_input_nodes):
            constant.add(node)
            node.meta[CONSTANT] = True


def loss_first(gm: fx.GraphModule) -> None:
    """A forward that returns a dict with a "loss" entry (as Hugging Face models' outputs hold
    one) returns (loss, the other entries in order) instead: the loss is what trains, and the
    trainer reads it first, as from a tuple."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    if isinstance(result, dict) and "loss" in result:
        output.args = ((result["loss"], *(v for k, v in result.items() if k != "loss")),)
        gm.recompile()


def check_loss(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """fxpar trains the value forward returns (or the first of a tuple, or a dict's "loss"): it
    must be a scalar floating-point loss, or the backward would start from logits summed as if
    they were one."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    val = result.meta.get("val") if isinstance(result, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point:
        return
    what = (f"a {val.dtype} tensor of shape {list(val.shape)}" if isinstance(val, torch.Tensor)
            else type(val).__name__ if val is not None else repr(result))
    raise CaptureError(f"{type(model).__name__}.forward returns {what}, not a scalar loss: "
                       f"fxpar back-propagates what forward returns; return the loss (first in a "
                       f"tuple, or as a dict's \"loss\"), or pass "
                       f"loss_fn=(output, targets) -> loss to autoparallelize / plan, with the "
                       f"targets as the last example input")


def tied_parameters(module: torch.nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of names that hold one parameter (lm_head.weight = wte.weight), first name first,
    as named_parameters() names it. The rewrites and the pipeline split must keep each group one
    parameter (runtime.training.tied), or its uses would train as copies that drift apart."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Set node.meta["val"] on every node, using fake tensors (no real memory is touched)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    with mode:  # fake inputs on the weights' device: only shapes and dtypes matter
        fakes = [torch.empty(x.shape, dtype=x.dtype, device=device)
                 if isinstance(x, torch.Tensor) else x for x in example_inputs]
    prop = _TrackingProp(gm, mode)
    try:
        with quiet_torch():
            prop.propagate(*fakes)
    except Exception as err:  # noqa: BLE001 - re-raised with the module and op named
        at = (node_where(prop.current, _module_paths) if prop.current is not None
              else where(err, gm))
        said = type(err).__name__ if data_dependent(err) else first_line(err)
        raise CaptureError(f"shape propagation failed {at}: {said}; {hint(err)}") from err


class _TrackingProp(FakeTensorProp):
    """FakeTensorProp that remembers the node it is running, to name it when one fails."""
    current: fx.Node | None = None

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm, mode)
        self.extra_traceback = False  # else torch appends the node, a traceback, tlparse's URL

    def run_node(self, n: fx.Node):
        self.current = n
        return super().run_node(n)


def _export(model, example_inputs, trace_error) -> fx.GraphModule:
    # torch.fx prints a failing graph's generated code to stderr; the error below says where
    try:
        with contextlib.redirect_stderr(io.StringIO()), quiet_torch():
            exported = torch.export.export(model, tuple(example_inputs), strict=False)
    except Exception as err:  # noqa: BLE001
        raise CaptureError(export_failure(model, err, trace_error)) from err
    # No guards on the example's shapes: the rewrites run the graph at other shapes (a
    # context-parallel rank sees seq/cp tokens), which the shape checks of each pass cover.
    try:
        return exported.module(check_guards=False)
    except TypeError:  # a torch without the option
        return exported.module()


def block_lists(model: torch.nn.Module) -> tuple[str, ...]:
    """Candidate parts: the outermost nn.ModuleLists (a list inside an element of another list -
    the experts of a mixture-of-experts block, per-head modules - is part of a block, however
    long it is). With several, a list counts only if each of its children is a block (two or
    more submodules holding parameters: attention, an MLP, norms), so a list of bare linears or
    embeddings beside the blocks stays in the layer around it; with one, any list does. Their
    children need not be alike (passes.capture.block_runs groups them); `_parts` then keeps those
    that run one after the other."""
    lists = _lists(model)
    def nested(name: str) -> bool:
        return any(name.startswith(f"{outer}.") for outer in lists if outer != name)
    outer = [name for name in lists if not nested(name) and len(model.get_submodule(name))]
    blocks = [name for name in outer if len(model.get_submodule(name)) >= 2 and all(
        _is_block(child) for child in model.get_submodule(name).children())]
    if len(blocks) >= 2:
        return tuple(blocks)
    largest = max(outer, key=lambda name: len(model.get_submodule(name)), default=None)
    return (largest,) if largest is not None else ()


def _lists(model: torch.nn.Module) -> list[str]:
    """The containers a model may hold its blocks in: every nn.ModuleList, and an nn.Sequential
    of two or more blocks (timm's `self.blocks = nn.Sequential(*blocks)`); a Sequential of
    layers (an MLP's Linear, GELU, Linear) is part of a block, not a list of blocks."""
    def of_blocks(m: torch.nn.Module) -> bool:
        return isinstance(m, torch.nn.Sequential) and len(m) >= 2 and \
            all(_is_block(child) for child in m.children())
    return [name for name, m in model.named_modules()
            if name and (isinstance(m, torch.nn.ModuleList) or of_blocks(m))]


def _named_lists(model: torch.nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The lists `names` gives, each checked to be a list of blocks of the model."""
    found = _lists(model)
    for name in names:
        if name not in found:
            raise CaptureError(f"parts: {name!r} is not an nn.ModuleList (or nn.Sequential of "
                               f"blocks) of "
                               f"{type(model).__name__}; its lists of layers are "
                               f"{', '.join(found[:6]) or 'none'}")
    return names


def _is_block(module: torch.nn.Module) -> bool:
    held = [m for m in module.modules() if m is not module
            and any(True for _ in m.parameters(recurse=False))]
    return len(held) >= 2


def _parts(gm: fx.GraphModule, lists: tuple[str, ...]) -> tuple[str, ...]:
    """The lists whose blocks run one list after the other, in the order they run (a vision
    tower then a decoder, an encoder then a decoder). Lists whose blocks interleave (two towers
    run in alternation, a list called twice) cannot be contiguous runs of pipeline stages: then
    only the longest one is split and the others run inside the layer around them."""
    if len(lists) < 2:
        return lists
    spans: dict[str, list[int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        found = _block_of(node, lists)
        if found:
            span = spans.setdefault(found.rsplit(".", 1)[0], [i, i])
            span[1] = i
    ordered = sorted(spans, key=lambda name: spans[name][0])
    if all(spans[a][1] < spans[b][0] for a, b in zip(ordered, ordered[1:])):
        return tuple(ordered)
    return (max(ordered, key=lambda name: spans[name][1] - spans[name][0]),)


def _module_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else key
        paths.append(re.sub(r"^L\['self'\]\.?", "", str(path)))
    return paths


def module_path(node: fx.Node) -> str | None:
    """The innermost module that made `node` ("blocks.0.attn"), None where none is recorded."""
    paths = _module_paths(node)
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths[-1] if paths and paths[-1] else None


def _block_of(node: fx.Node, prefixes: tuple[str, ...]) -> str | None:
    candidates = _module_paths(node)
    if node.op == "call_module":
        candidates.append(str(node.target))
    for prefix in prefixes:
        pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)(\.|$)")
        mangled = prefix.replace(".", "_")  # a path as some captures write it, "_" for "."
        for path in candidates:
            match = pattern.match(path)
            if not match and path.startswith(mangled):  # only its rest: the list's own name
                # may hold "_" (joint_blocks, transformer_blocks)
                match = pattern.match(prefix + path[len(mangled):].replace("_", "."))
            if match:
                return f"{prefix}.{match.group(1)}"
    return None


def _group_layers(gm: fx.GraphModule, prefixes: tuple[str, ...]) -> tuple[Layer, ...]:
    nodes = list(gm.graph.nodes)
    assigned: dict[fx.Node, str] = {}
    for n in nodes:
        if n.op in ("call_module", "call_function", "call_method"):
            block = _block_of(n, prefixes)
            if block:
                assigned[n] = block
    blocks = list(dict.fromkeys(assigned.values()))
    order = {block: i for i, block in enumerate(blocks)}
    first = next((i for i, n in enumerate(nodes) if n in assigned), len(nodes))
    last = max((i for i, n in enumerate(nodes) if n in assigned), default=-1)
    ran = None  # the block whose node ran last, in graph order
    for i, n in enumerate(nodes):
        if n in assigned and assigned[n] in order:
            ran = assigned[n]
        if n in assigned or n.op in ("placeholder", "get_attr"):
            continue
        assigned[n] = ("embed" if i < first else "head" if i > last
                       else _nearest_block(n, assigned, order, ran))
    for n in nodes:  # inputs and constants live with their first user
        if n.op in ("placeholder", "get_attr"):
            assigned[n] = next((assigned[u] for u in n.users if u in assigned), "embed")
    order = (["embed"] if "embed" in assigned.values() else []) + blocks + ["head"]
    return tuple(_make_layer(name, i, [n for n in nodes if assigned[n] == name], blocks)
                 for i, name in enumerate(order) if name in assigned.values())


def _read_sizes_where_used(gm: fx.GraphModule, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
    """The layers with every size read from another layer read again where it is used
    (passes.capture.size_copies)."""
    owner = {name: layer.name for layer in layers for name in layer.nodes}
    new = copy_size_reads(gm, owner)
    if new == owner:
        return layers
    gm.recompile()
    blocks = [layer.name for layer in layers if layer.kind == "block"]
    return tuple(_make_layer(layer.name, layer.index,
                             [n for n in gm.graph.nodes if new.get(n.name) == layer.name], blocks)
                 for layer in layers)


def _nearest_block(node: fx.Node, assigned: dict, order: dict[str, int], ran: str) -> str:
    """A node between blocks with no module of its own belongs to the block that ran last
    before it when it reads some block's output (`x + block(x)` written in the parent goes with
    the block; a projector after a vision tower with its last block): every layer then reads
    earlier ones only, and each layer's nodes stay one stretch of the graph, as recomputing a
    layer needs - also where the tower's last block is not the one whose output is read (Llava
    reads the next-to-last). One that reads no block's output (a decoder's embedding between an
    encoder and the decoder, the decoder's masks) is computed with the embedding, on the first
    stage, and carried to the blocks that read it."""
    if any(assigned.get(arg) in order for arg in node.all_input_nodes):
        return ran
    return "embed"


def _make_layer(name: str, index: int, nodes: list[fx.Node], blocks: list[str]) -> Layer:
    kind = "embed" if name == "embed" else "head" if name == "head" else "block"
    return Layer(name, index, kind, tuple(n.name for n in nodes), _signature(nodes, name))


def _signature(nodes: list[fx.Node], layer: str) -> str:
    """Ops, targets (with the layer's own prefix removed), shapes and the ops' constant
    arguments: equal for identical blocks. The constants matter: GPT-OSS's sliding and full
    attention layers differ only in the window an attention op takes."""
    strip = layer.replace(".", "_")
    parts = []
    for n in nodes:
        target = str(n.target).replace(layer, "").replace(strip, "")
        target = re.sub(r"lifted_tensor_\d+", "lifted_tensor", target)  # numbered model-wide
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        constants = _constants((n.args, n.kwargs)) if n.op == "call_function" else ()
        parts.append(f"{n.op}:{target}:{shape}:{constants}")
    return str(hash("|".join(parts)))


def _constants(value):
    """The plain constants in an op's arguments (numbers, strings, dtypes), nodes left out."""
    if isinstance(value, (tuple, list)):
        return tuple(_constants(v) for v in value if not isinstance(v, fx.Node))
    if isinstance(value, dict):
        return tuple((k, _constants(v)) for k, v in sorted(value.items())
                     if not isinstance(v, fx.Node))
    if isinstance(value, slice):  # x[:, :t]: its bounds, a node's name never (it is numbered)
        return ("slice", *(v if not isinstance(v, fx.Node) else "node"
                           for v in (value.start, value.stop, value.step)))
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def tensor_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def _layer_graph(gm: fx.GraphModule, layers: tuple[Layer, ...]) -> nx.DiGraph:
    graph = nx.DiGraph()
    owner = {}
    for layer in layers:
        graph.add_node(layer.name, kind=layer.kind, index=layer.index, signature=layer.signature)
        owner.update({n: layer.name for n in layer.nodes})
    for node in gm.graph.nodes:
        src = owner.get(node.name)
        for user in node.users:
            dst = owner.get(user.name)
            if src and dst and src != dst and node.op != "placeholder":
                if not graph.has_edge(src, dst):
                    graph.add_edge(src, dst, tensors=set(), bytes=0)
                edge = graph.edges[src, dst]
                if node.name not in edge["tensors"]:
                    edge["tensors"].add(node.name)
                    edge["bytes"] += tensor_bytes(node.meta.get("val"))
    return graph
