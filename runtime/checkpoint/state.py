"""Checkpoints of a PipelineTrainer with torch.distributed.checkpoint (DCP): parameters, optimizer
state, step, data position, RNG states and the loss scale, saved under one mesh and loaded under
any other (another tp, pp, cp, dp or number of ranks).

What is saved, by key (every tensor keyed by the model's full parameter name, so it reshards):

    model/<name>             the parameter, as this rank's pieces of the full tensor
                             (runtime.checkpoint.dcp_slices: tp shards, fused QKV chunks, vocabulary padding
                             left out; replicas name the same piece and DCP writes it once);
                             a parameter no stage program reads (a vision tower's unused final
                             norm) whole, from the model, so that an export holds the whole
                             model and a resume gives it back
    optim/<name>/<key>       an optimizer state shaped like its parameter (Adam's exp_avg, SGD's
                             momentum_buffer), described by the same pieces; other tensors (Adam's
                             step) whole; anything else pickled. Under sharded data parallel
                             (runtime.data_parallel.sharded_dp) the optimizer steps one flat shard per bucket:
                             each parameter's range of it (ShardedDP.slices) is described as
                             boxes of the tp shard (dcp_slices.flat_range_pieces) mapped to the
                             full tensor (dcp_slices.to_full), under the same key, so it loads
                             into any other layout, sharded or not. Under ZeRO-3 the parameters'
                             values are saved from, and loaded into, the shards in the same way.
    optim/param_groups       the optimizer's hyperparameters (lr, betas, ...), without params
    trainer                  step, data position, loss scale, the caller's extra values
    rng/<rank>               each rank's torch (default and runtime.training.rng's tensor-parallel
                             dropout stream) / Python / NumPy (/ CUDA) generator states

Atomicity: every rank writes into `<path>.partial`; when DCP has returned on every rank (the
coordinator writes DCP's .metadata last) a barrier follows, then rank 0 writes MARKER and renames
the folder to `<path>`. A run killed mid-save leaves only a `.partial` folder, which `latest`
skips, so the previous checkpoint stays the one a resume loads.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from runtime.checkpoint.dcp_slices import (Slices, SlicesLoadPlanner, SlicesSavePlanner, flat_range_pieces,
                                shard_pieces, to_full, whole)
from runtime.training import rng
from runtime.programs.shards import shard_specs
from runtime.training.tied import canonical_names

MARKER = "fxpar-checkpoint.json"
_STEP_DIR = re.compile(r"step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit the model being loaded."""


# -- what a rank holds, described by full name -----------------------------------------------------
@dataclass(frozen=True)
class Held:
    """One parameter on this rank. `describe` gives a tensor shaped like `param` as pieces of
    the full tensor. `opt` is what the optimizer steps for it: the parameter itself, or under
    sharded data parallel its ZeRO bucket's flat shard (None: this rank's shard holds none of
    it), and `describe_opt` gives this parameter's part of a tensor shaped like `opt`.
    `values_in_opt`: ZeRO-3 frees the parameter between uses; its values live in the shard."""

    param: torch.nn.Parameter
    describe: Callable
    opt: torch.nn.Parameter | None
    describe_opt: Callable
    values_in_opt: bool = False

    def model_entry(self):
        """The parameter's values on this rank as pieces (None: it holds none of them)."""
        if not self.values_in_opt:
            return self.describe(self.param.data)
        return self.describe_opt(self.opt.data) if self.opt is not None else None


def local_parameters(trainer) -> dict[str, Held]:
    """Full parameter name -> Held, for every parameter of this rank's stage programs. Tied
    copies are listed once, by the model's own name."""
    canonical = canonical_names(tuple(c.names for c in trainer.tied))
    zero = _zero_ranges(trainer, canonical)
    level = getattr(getattr(trainer, "sharded", None), "level", 0)
    found: dict[str, Held] = {}
    for program in trainer.programs.values():
        specs = shard_specs(program.gm)
        for name, param in program.gm.named_parameters():
            full = canonical.get(name, name)
            if full in found:
                continue
            spec = specs.get(name)
            describe = (whole if spec is None
                        else (lambda t, spec=spec: shard_pieces(t, spec)))
            if id(param) in zero["bucketed"]:
                bucket, part = zero["ranges"].get(full, (None, None))
                found[full] = Held(param, describe, bucket.shard if bucket else None,
                                   lambda t, part=part, spec=spec: _range_pieces(t, part, spec),
                                   values_in_opt=level == 3)
            else:
                found[full] = Held(param, describe, param, describe)
    return found


def _zero_ranges(trainer, canonical: dict) -> dict:
    """Under sharded data parallel (runtime.data_parallel.sharded_dp): ids of the parameters in ZeRO buckets,
    and full name -> (bucket, ShardSlice) of those this rank's shards hold a range of."""
    sharded = getattr(trainer, "sharded", None)
    if sharded is None or not getattr(sharded, "level", 0):
        return {"bucketed": set(), "ranges": {}}
    buckets = {b.index: b for b in sharded.buckets}
    return {"bucketed": {id(p) for b in sharded.buckets for p in b.params},
            "ranges": {canonical.get(n, n): (buckets[part.bucket], part)
                       for n, part in sharded.slices().items()}}


def _range_pieces(flat: torch.Tensor, part, spec) -> Slices:
    """One parameter's range of a ZeRO bucket's flat shard (or of an optimizer state shaped like
    it) as pieces of the full tensor."""
    segment = flat[part.local_start: part.local_start + part.stop - part.start]
    local = flat_range_pieces(segment, part.shape, part.start)
    return to_full(local, spec) if spec is not None else local


def _optimizer_entries(trainer, params: dict[str, Held]) -> dict[str, object]:
    entries: dict[str, object] = {}
    for name, held in params.items():
        if held.opt is None:
            continue
        for key, value in trainer.optimizer.state.get(held.opt, {}).items():
            if torch.is_tensor(value) and value.shape == held.opt.shape:
                entries[f"optim/{name}/{key}"] = held.describe_opt(value)
            elif torch.is_tensor(value) and value.numel() > 1:
                # replicas would name the same key with different values: refuse, not lose
                raise CheckpointError(f"optimizer state {key!r} of {name} has shape "
                                      f"{tuple(value.shape)}, neither that of what the "
                                      f"optimizer steps {tuple(held.opt.shape)} nor a scalar; "
                                      f"describe it with runtime.checkpoint.dcp_slices")
            else:
                entries[f"optim/{name}/{key}"] = value
    return entries


def _param_groups(optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "tp": rng.tp_generator().get_state(), "seed": torch.initial_seed()}
    try:
        import numpy
        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, own: bool, groups, step: int) -> None:
    """This rank's saved generator states (`own`: saved by this rank under the same mesh); else
    rank 0's Python and NumPy states, and torch's two dropout streams seeded anew for this rank's
    coordinates as runtime.training.rng seeds them, from rank 0's seed and the step."""
    if own:
        torch.set_rng_state(state["torch"])
        if "tp" in state:
            rng.tp_generator().set_state(state["tp"])
    else:
        rng.seed_ranks(state["seed"] + 1_000_003 * step, groups.tp_index, groups.pp_index,
                       groups.dp_index, groups.cp_index)
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy
        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _trainer_state(trainer, info: dict) -> dict:
    scaler = trainer.scaler
    return {**info, "loss_scale": (scaler.scale, scaler.good_steps) if scaler else None}


# -- save ------------------------------------------------------------------------------------------
def save(trainer, path: str, info: dict, files: dict[str, str] | None = None,
         model: torch.nn.Module | None = None) -> str:
    """Save this rank's part of the trainer's state into the checkpoint folder `path` (collective:
    every rank calls it). `info` holds step, data_position and extra values (picklable); step and
    data position go to MARKER too. `files`: name -> text rank 0 writes into the folder (what
    an export needs to know of the model). `model`: the model the trainer was built from, whose
    parameters no stage program reads rank 0 saves whole. Returns the absolute path."""
    path = os.path.abspath(path)
    partial, rank = path + ".partial", dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save killed earlier
        os.makedirs(partial)
    dist.barrier()
    params = local_parameters(trainer)
    state = _model_entries(params)
    unread = _unread_entries(model, params)  # collective
    if rank == 0:
        state.update(unread)
    state.update(_optimizer_entries(trainer, params))
    state["optim/param_groups"] = _param_groups(trainer.optimizer)
    state["trainer"] = _trainer_state(trainer, info)
    state[f"rng/{rank}"] = _rng_state()
    dcp.save(state, storage_writer=FileSystemWriter(partial), planner=SlicesSavePlanner())
    dist.barrier()  # every rank's files are written and DCP's metadata with them
    if rank == 0:
        for name, text in (files or {}).items():
            with open(os.path.join(partial, name), "w") as f:
                f.write(text)
        _finish(partial, path, trainer, info)
    dist.barrier()
    return path


def _finish(partial: str, path: str, trainer, info: dict) -> None:
    mesh = trainer.groups.mesh
    marker = {"step": info.get("step"), "data_position": info.get("data_position"),
              "world_size": dist.get_world_size(),
              "mesh": {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp},
              "saved_at": time.time()}
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):  # saving the same step again: the old one goes only now
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, path)


# -- find ------------------------------------------------------------------------------------------
def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def latest(root: str) -> str | None:
    """The complete checkpoint of the highest step under `root` (folders step-N), or None."""
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), entry) for entry in os.listdir(root)
             if (m := _STEP_DIR.match(entry)) and is_complete(os.path.join(root, entry))]
    return os.path.join(root, max(steps)[1]) if steps else None


def resolve(path: str) -> str:
    """`path` if it is a complete checkpoint, else the latest complete one under it."""
    if is_complete(path):
        return path
    found = latest(path)
    if found is None:
        what = ("an incomplete checkpoint (a save that did not finish)"
                if os.path.isdir(path) and os.path.exists(os.path.join(path, ".metadata"))
                or path.endswith(".partial") else "no complete checkpoint")
        raise CheckpointError(f"{path} holds {what}: give a folder written by save (with "
                              f"{MARKER}) or a folder of step-N checkpoints")
    return found


def read_marker(path: str) -> dict:
    with open(os.path.join(resolve(path), MARKER)) as f:
        return json.load(f)


# -- load ------------------------------------------------------------------------------------------
def load(trainer, path: str, model: torch.nn.Module | None = None) -> dict:
    """Load a checkpoint saved under any mesh into this rank's trainer, in place (collective).
    Returns the saved info (step, data_position, extra). Under the same mesh every rank takes
    its own RNG states back (both dropout streams of runtime.training.rng); under another, see
    _set_rng_state."""
    path = resolve(path)
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    params = local_parameters(trainer)
    unread = {key: value for key, value in _unread_entries(model, params).items()
              if key in metadata}  # a checkpoint saved without them leaves the model's own
    _check_parameters(params, metadata, path, unread)
    state = {**_model_entries(params), **unread}
    optim = _optimizer_placeholders(params, metadata)
    state.update({key: entry for key, (_, entry) in optim.items()})
    marker = read_marker(path)
    mesh = trainer.groups.mesh
    same = marker["mesh"] == {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp}
    rng_key = f"rng/{dist.get_rank()}" if same else "rng/0"
    state.update({"optim/param_groups": None, "trainer": None, rng_key: None})
    with torch.no_grad():
        dcp.load(state, storage_reader=FileSystemReader(path), planner=SlicesLoadPlanner())
    _restore_optimizer(trainer, params, optim, state, state["optim/param_groups"], path)
    saved = state["trainer"]
    if trainer.scaler is not None and saved.get("loss_scale") is not None:
        trainer.scaler.scale, trainer.scaler.good_steps = saved["loss_scale"]
    _set_rng_state(state[rng_key], same, trainer.groups, saved.get("step") or 0)
    return {k: v for k, v in saved.items() if k != "loss_scale"}


def _model_entries(params: dict[str, Held]) -> dict[str, object]:
    entries = {f"model/{name}": held.model_entry() for name, held in params.items()}
    return {key: value for key, value in entries.items() if value is not None}


def _unread_entries(model, params: dict[str, Held]) -> dict[str, torch.Tensor]:
    """model/<name> -> the model's own tensor, for each parameter with values that no rank's
    stage programs hold (collective: the names are gathered from every rank)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(params))
    if model is None:
        return {}
    held = {name for names in everyone for name in names}
    return {f"model/{name}": p.data for name, p in model.named_parameters()
            if name not in held and not p.is_meta}


def _check_parameters(params: dict, metadata: dict, path: str, unread: dict) -> None:
    """Every parameter of the model is in the checkpoint with its full shape, and the checkpoint
    holds no parameter the model lacks (compared over all ranks: each holds only its stages)."""
    for name, held in params.items():
        md = metadata.get(f"model/{name}")
        if md is None:
            raise CheckpointError(f"checkpoint {path} has no parameter {name}: it was saved "
                                  f"from another model")
        shape = held.describe(held.param.data).size()
        if not isinstance(md, TensorStorageMetadata) or md.size != shape:
            raise CheckpointError(f"parameter {name}: checkpoint {path} holds shape "
                                  f"{tuple(getattr(md, 'size', ()))}, the model "
                                  f"{tuple(shape)}")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(params))
    held = {name for names in everyone for name in names}
    extra = sorted(k[len("model/"):] for k in metadata if k.startswith("model/")
                   and k[len("model/"):] not in held and k not in unread)
    if extra:
        raise CheckpointError(f"checkpoint {path} holds parameters the model lacks: "
                              f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")


def _optimizer_placeholders(params: dict[str, Held], metadata: dict) -> dict[str, tuple]:
    """key -> (the local value to restore, its state-dict entry): tensors to load the saved
    optimizer states into, made from the checkpoint's metadata (an optimizer holds no state
    before its first step). Parameters of one ZeRO bucket share one tensor per state."""
    entries: dict[str, tuple] = {}
    shared: dict[tuple, torch.Tensor] = {}
    for name, held in params.items():
        prefix = f"optim/{name}/"
        if held.opt is None:
            continue
        for key, md in metadata.items():
            if not key.startswith(prefix):
                continue
            if isinstance(md, BytesStorageMetadata):
                entries[key] = (None, None)
            elif md.size == held.describe(held.param.data).size():
                state_key = (id(held.opt), key[len(prefix):], md.properties.dtype)
                if state_key not in shared:
                    shared[state_key] = torch.zeros_like(held.opt.data,
                                                         dtype=md.properties.dtype)
                local = shared[state_key]
                entries[key] = (local, held.describe_opt(local))
            else:
                local = torch.zeros(md.size, dtype=md.properties.dtype)
                entries[key] = (local, local)
    return entries


def _restore_optimizer(trainer, params, optim, state, groups, path: str) -> None:
    optimizer = trainer.optimizer
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path} has {len(groups)} optimizer parameter "
                              f"groups, this optimizer {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)
    for name, held in params.items():
        prefix = f"optim/{name}/"
        values = {key[len(prefix):]: (local if local is not None else state[key])
                  for key, (local, _) in optim.items() if key.startswith(prefix)}
        if values:
            optimizer.state[held.opt].update(values)
