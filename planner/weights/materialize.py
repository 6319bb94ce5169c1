"""Models built on the meta device, materialised per shard: no rank ever holds the whole model.

A model built under `torch.device("meta")` has shapes but no values. It is captured, rewritten and
split into stage programs on the meta device; then `materialize_programs` gives each parameter and
buffer of this rank's programs its values, one parameter at a time:

  parameter  the full tensor comes from a *source* — pretrained weights (planner.weights.hf_weights reads only
             this rank's slice) or the init rule below — and this rank keeps its shard
             (runtime.programs.shards.ShardSpec), so the extra memory at any moment is one full parameter;
  buffer     a real buffer of the model is taken as it is; a meta one (rotary tables, masks) is
             recomputed by building its owner module again from its `cfg` / `config`; an index
             table a rewrite made on the meta device carries its values (passes.rewrite.tables).

The init rule is independent of the plan: parameter NAME of the full model is initialised by its
owner module's own `reset_parameters()` (a Hugging Face model's `_init_weights`) on an empty
copy of that module alone, with the global generator seeded from (seed, NAME). Tied names use the
model's first name. `materialize_full` applies the same rule to a whole model in one process, so a
one-process reference equals the parallel model under every plan.

Graphs captured from a meta model may name the meta device in constants (torch.export records
`arange(..., device=meta)`); `retarget` points them at the device the programs run on.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn

from runtime.programs.shards import ShardSpec

META = torch.device("meta")
# source(full name, spec or None, full shape) -> this rank's tensor (the shard when spec is given)
Source = Callable[[str, ShardSpec | None, tuple[int, ...]], torch.Tensor]


class MaterializeError(ValueError):
    """A tensor of a meta model that cannot be given values; names it and says what to do."""


def is_meta(model: nn.Module) -> bool:
    """True when the model's parameters are on the meta device (it must be materialised)."""
    return any(p.is_meta for p in model.parameters())


def capture_inputs(model: nn.Module, inputs: tuple) -> tuple:
    """Example inputs for capturing `model`: on the meta device when the model is, because
    torch.export refuses inputs and weights on different devices."""
    if not is_meta(model):
        return inputs
    return tuple(x.to(META) if isinstance(x, torch.Tensor) else x for x in inputs)


def param_seed(seed: int, name: str) -> int:
    """The seed of one parameter: a hash of (seed, full name), the same under every plan."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


def _hf_init(model: nn.Module) -> Callable | None:
    """A Hugging Face model's per-module init (`_init_weights`), if the model is one."""
    for module in model.modules():
        init = getattr(module, "_init_weights", None)
        if callable(init):
            return init
    return None


def init_value(model: nn.Module, name: str, seed: int = 0,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The full initial value of parameter `name` (a name of the full model): its owner module's
    own init on an empty copy of that module alone, the generator seeded by (seed, name)."""
    owner, leaf = _owner(model, name)
    clone = copy.deepcopy(owner)            # meta: costs nothing
    clone.to_empty(device=device, recurse=False)
    hf_init = _hf_init(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(param_seed(seed, name))
        with torch.no_grad():
            if hf_init is not None:        # a Hugging Face model initialises as it defines
                hf_init(clone)
            elif hasattr(clone, "reset_parameters"):
                clone.reset_parameters()
            else:
                raise MaterializeError(
                    f"parameter {name} of the meta model has no init rule: its module "
                    f"{type(owner).__name__} has no reset_parameters(); give pretrained weights "
                    f"(weights=DIR) or build the model with real weights")
    value = getattr(clone, leaf).detach()
    if value.is_meta:
        raise MaterializeError(f"parameter {name}: {type(owner).__name__}'s init left it on the "
                               f"meta device")
    return value


def init_source(model: nn.Module, seed: int = 0, device="cpu") -> Source:
    """The init rule as a source: the full value, cut to this rank's shard."""
    def source(name: str, spec: ShardSpec | None, shape: tuple[int, ...]) -> torch.Tensor:
        full = init_value(model, name, seed, device)
        return spec.take(full) if spec is not None else full
    return source


def buffer_value(model: nn.Module, name: str, device="cpu", _built: dict | None = None
                 ) -> torch.Tensor:
    """The value of buffer `name`: the model's own when real; a meta buffer is recomputed by
    building its owner module again from its config (its parameters are built and dropped)."""
    owner, leaf = _owner(model, name)
    value = getattr(owner, leaf)
    if not value.is_meta:
        return value.to(device)
    cfg = getattr(owner, "cfg", None) or getattr(owner, "config", None)
    hf_init = _hf_init(model)
    if cfg is None and hf_init is not None:   # transformers' init sets buffers too (embed_scale)
        clone = copy.deepcopy(owner)
        clone.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            hf_init(clone)
        value = getattr(clone, leaf)
        if not value.is_meta:
            return value.detach()
    if cfg is None:
        raise MaterializeError(
            f"buffer {name} of the meta model ({type(owner).__name__}) cannot be recomputed: the "
            f"module has no cfg or config to build it again from; build the model with its "
            f"buffers on a real device (only parameters on meta)")
    built = _built if _built is not None else {}
    if id(owner) not in built:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            built[id(owner)] = type(owner)(cfg)
    return getattr(built[id(owner)], leaf).detach()


def materialize_full(model: nn.Module, seed: int = 0, device="cpu",
                     source: Source | None = None) -> nn.Module:
    """The one-process counterpart: every parameter and buffer of a meta model given its values
    by the same rule as `materialize_programs` (one parameter at a time), in place."""
    source = source or init_source(model, seed, device)
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)     # tied: the model's first name
    made: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            value = source(names[id(p)], None, tuple(p.shape)).to(p.dtype)
            made[id(p)] = nn.Parameter(value, p.requires_grad)
        owner, leaf = _owner(model, name)
        setattr(owner, leaf, made[id(p)])
    built: dict = {}
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        owner, leaf = _owner(model, name)
        owner._buffers[leaf] = buffer_value(model, name, device, built)
    return model


def _full_shape(local: torch.Tensor, *specs: ShardSpec | None) -> tuple[int, ...]:
    shape = list(local.shape)
    for spec in specs:
        if spec is not None:
            shape[spec.dim] = shape[spec.dim] * spec.parts - spec.pad
    return tuple(shape)


def _own(gm: nn.Module, prefix: str, owned: dict[int, nn.Module]) -> nn.Module:
    """The module at `prefix` of gm, made gm's own: a stage program shares its leaf modules with
    the model it was cut from, so each module on the path is replaced by a shallow copy (once)
    before a tensor is set on it, and the user's model is never changed."""
    module = gm
    copies = {id(m) for m in owned.values()}
    for part in prefix.split(".") if prefix else ():
        child = getattr(module, part)
        if id(child) not in copies:
            if id(child) not in owned:
                copied = copy.copy(child)
                copied._parameters = dict(child._parameters)
                copied._buffers = dict(child._buffers)
                copied._modules = dict(child._modules)
                owned[id(child)] = copied
                copies.add(id(copied))
            setattr(module, part, owned[id(child)])
            child = owned[id(child)]
        module = child
    return module


def materialize_programs(programs: Iterable, model: nn.Module, canonical: dict[str, str],
                         source: Source, device="cpu", only_meta: bool = True) -> None:
    """Give this rank's stage programs (runtime.programs.stage.StageProgram, names as in the full model)
    their values in place: each parameter from `source` (this rank's shard only; with only_meta
    False, real ones too), each meta buffer from `model` (`buffer_value`, `model` untouched by
    the rewrites); then no tensor is left on the meta device."""
    made: dict[int, nn.Parameter] = {}
    built: dict = {}
    owned: dict[int, nn.Module] = {}
    for program in programs:
        gm = program.gm
        for name, p in list(gm.named_parameters(remove_duplicate=False)):
            if only_meta and not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = _shard_value(p, canonical.get(name, name), source, device)
            prefix, _, leaf = name.rpartition(".")
            setattr(_own(gm, prefix, owned), leaf, made[id(p)])
        for name, b in list(gm.named_buffers(remove_duplicate=False)):
            if b.is_meta:
                prefix, _, leaf = name.rpartition(".")
                _own(gm, prefix, owned)._buffers[leaf] = _program_buffer(model, name, b, device,
                                                                          built)
        retarget(gm, device)
        _check_nothing_meta(gm, program.stage)


def _shard_value(p: torch.Tensor, full: str, source: Source, device) -> nn.Parameter:
    """This rank's parameter in place of `p` (its shard spec and other tags kept)."""
    spec = getattr(p, "fxpar_shard", None)
    expert = getattr(p, "fxpar_expert", None)   # experts cut over the ep ranks (dim 0)
    if expert is None:
        value = source(full, spec, _full_shape(p, spec))
    else:
        value = expert.take(source(full, None, _full_shape(p, spec, expert)))
        value = spec.take(value) if spec is not None else value
    value = value.to(device, p.dtype)
    if tuple(value.shape) != tuple(p.shape):
        raise MaterializeError(f"parameter {full}: the source gave shape {list(value.shape)}, "
                               f"this rank's shard is {list(p.shape)}")
    new = nn.Parameter(value.contiguous(), p.requires_grad)
    # fxpar_shard and other tags travel along (only they: a fake parameter's own fields, its
    # fake device among them, stay the new tensor's)
    new.__dict__.update({k: v for k, v in p.__dict__.items() if k.startswith("fxpar_")})
    return new


def shard_device() -> torch.device:
    """Where a rank's shard lives: its CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Values:
    """Where a rank's shard gets its values: `source` per parameter, buffers from `model` (a
    copy taken before the rewrites, which may cut the model's own modules)."""

    source: Source
    model: nn.Module
    only_meta: bool
    close: Callable[[], None] = lambda: None


def _faking() -> bool:
    from torch._guards import detect_fake_mode
    return detect_fake_mode() is not None


def _empty_source(name: str, spec: ShardSpec | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Under a FakeTensorMode: the shard's shape, no value (nothing is initialised or read)."""
    full = torch.empty(shape)
    return spec.take(full) if spec is not None else full


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of a meta model, made outside any FakeTensorMode (a dry run shards under one,
    planner.bench.dry_run, where copying would turn meta parameters into fake tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return copy.deepcopy(model)


def value_source(model: nn.Module, weights: str | None, seed: int = 0) -> Values | None:
    """None for a model with real weights and no checkpoint (sharded from its own values, as
    always); a checkpoint reader for weights=DIR; the init rule for a meta model. Call it
    before capturing: it records the full model's shapes."""
    if weights is None and not is_meta(model):
        return None
    pristine = _meta_copy(model) if is_meta(model) else model
    if _faking():   # a dry run (planner.bench.dry_run): shapes, no values
        return Values(_empty_source, pristine, only_meta=weights is None)
    if weights is not None:
        from planner.weights.hf_weights import ShardReader
        reader = ShardReader(weights, pristine)
        return Values(reader, pristine, only_meta=False, close=reader.close)
    return Values(init_source(pristine, seed, shard_device()), pristine, only_meta=True)


def give_values(programs: dict, values: Values | None, tied: tuple[tuple[str, ...], ...]) -> None:
    """Materialise this rank's stage programs from `values` (see value_source)."""
    if values is None:
        return
    from runtime.training.tied import canonical_names
    try:
        materialize_programs(programs.values(), values.model, canonical_names(tied),
                             values.source, shard_device(), values.only_meta)
    finally:
        values.close()


def _program_buffer(model, name: str, b: torch.Tensor, device, built) -> torch.Tensor:
    """The value of a program's buffer `b`, in b's dtype: a module's init computes some in fp32
    whatever the model's dtype (rotary frequencies), and the program was captured with b's."""
    value = getattr(b, "fxpar_value", None)      # a table a rewrite pass made (index, positions)
    if value is not None:
        return value.to(device=device, dtype=b.dtype)
    try:
        model.get_buffer(name)
    except AttributeError:
        raise MaterializeError(f"buffer {name} of a stage program is a table a rewrite made on "
                               f"the meta device without its values (passes.rewrite.tables keeps "
                               f"them), so it has no value; build the model with real weights "
                               f"for this plan") from None
    return buffer_value(model, name, device, built).to(b.dtype)


def retarget(gm: fx.GraphModule, device) -> None:
    """Nodes that name the meta device (constants torch.export recorded, as a keyword or as an
    argument: `aten.to.device(x, meta, ...)`) name `device`."""
    device, changed = torch.device(device), False

    def swap(arg):
        nonlocal changed
        if isinstance(arg, torch.device) and arg.type == "meta":
            changed = True
            return device
        return arg
    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    if changed:
        gm.recompile()


def _check_nothing_meta(gm: nn.Module, stage: int) -> None:
    left = [n for n, t in [*gm.named_parameters(), *gm.named_buffers()] if t.is_meta]
    left += [n for n, t in vars(gm).items() if isinstance(t, torch.Tensor) and t.is_meta]
    if left:
        raise MaterializeError(f"stage {stage} still holds meta tensors after materialisation: "
                               f"{', '.join(left[:5])}; build the model with real weights")
