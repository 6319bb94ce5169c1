"""Hugging Face safetensors checkpoints, read per shard, and the fxpar <-> Hugging Face name map.

A checkpoint directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`
(its "weight_map": tensor name -> file), as `save_pretrained` writes them. Each rank reads only the
slices its shard needs (`safe_open(...).get_slice(name)[...]`): a tensor-parallel shard
(runtime.programs.shards.ShardSpec: column, row, vocabulary with padding, interleaved chunks of a fused QKV)
is read as the ranges of rows or columns it takes, never the whole tensor.

The name map (`name_map(model)`) says, for every parameter of an fxpar model (its full name, as
`named_parameters()` gives it; a tied parameter under its first name), which checkpoint tensor holds
it and how (`HFTensor`: its name, and whether fxpar holds its transpose — GPT-2's Conv1D stores
[in, out] where nn.Linear holds [out, in]). It covers:

  HFCausalLM (planner.models.hf)    "model." + the Hugging Face name, as is
  planner.models.presets.Llama       Hugging Face Llama names (q/k/v/o_proj, gate/up/down_proj, norms)
  planner.models.presets.GPT         Hugging Face GPT-2 names (fused c_attn, Conv1D weights transposed)

`NameMap.to_hf_state(full_state)` turns full fxpar tensors into a Hugging Face state dict (for an
export) and `NameMap.from_hf_state` the reverse. A checkpoint is checked against the map before
anything is read: a missing, extra or mis-shaped tensor is an error naming the tensor, the file and
the expected shape.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn

from runtime.programs.shards import ShardSpec

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class WeightsError(ValueError):
    """A checkpoint that does not fit the model; names the tensor, the file and the shape."""


@dataclass(frozen=True)
class HFTensor:
    """Where one fxpar parameter is stored: the checkpoint tensor's name, and whether the
    checkpoint holds the transpose of fxpar's tensor (2-D only)."""

    name: str
    transpose: bool = False

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def to_hf(self, value: torch.Tensor) -> torch.Tensor:
        return value.t().contiguous() if self.transpose else value

    def from_hf(self, value: torch.Tensor) -> torch.Tensor:
        return value.t().contiguous() if self.transpose else value


@dataclass(frozen=True)
class NameMap:
    """fxpar full parameter name -> HFTensor, for every parameter (tied ones under their first
    name); `aliases` are further checkpoint names of a tied tensor (lm_head.weight), which a
    checkpoint may hold or leave out."""

    entries: tuple[tuple[str, HFTensor], ...]
    aliases: tuple[str, ...] = ()

    def to_hf(self, name: str) -> HFTensor:
        found = dict(self.entries).get(name)
        if found is None:
            raise KeyError(f"{name} is not a parameter of the mapped model")
        return found

    def from_hf(self, hf_name: str) -> str:
        for name, ref in self.entries:
            if ref.name == hf_name:
                return name
        raise KeyError(f"{hf_name} holds no parameter of the mapped model")

    def to_hf_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full fxpar tensors (pm.full_state_dict()) -> Hugging Face names and layouts."""
        return {ref.name: ref.to_hf(full[name]) for name, ref in self.entries}

    def from_hf_state(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: ref.from_hf(hf[ref.name]) for name, ref in self.entries}


def _first_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(first name of every parameter, the further names of tied ones)."""
    seen, first, alias = set(), [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        (alias if id(p) in seen else first).append(name)
        seen.add(id(p))
    return first, alias


_LLAMA = [(r"embed\.weight", "model.embed_tokens.weight"),
          (r"blocks\.(\d+)\.norm1\.weight", r"model.layers.\1.input_layernorm.weight"),
          (r"blocks\.(\d+)\.norm2\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
          (r"blocks\.(\d+)\.attn\.([qkvo])_proj\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
          (r"blocks\.(\d+)\.(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
          (r"norm\.weight", "model.norm.weight"), (r"lm_head\.weight", "lm_head.weight")]
_GPT = [(r"(wte|wpe|ln_f)\.(weight|bias)", r"transformer.\1.\2"),
        (r"blocks\.(\d+)\.ln([12])\.(weight|bias)", r"transformer.h.\1.ln_\2.\3"),
        (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"transformer.h.\1.attn.c_attn.\2"),
        (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"transformer.h.\1.attn.c_proj.\2"),
        (r"blocks\.(\d+)\.fc1\.(weight|bias)", r"transformer.h.\1.mlp.c_fc.\2"),
        (r"blocks\.(\d+)\.fc2\.(weight|bias)", r"transformer.h.\1.mlp.c_proj.\2"),
        (r"lm_head\.weight", "lm_head.weight")]


def _by_rules(name: str, rules, transposed: bool) -> HFTensor:
    for pattern, template in rules:
        if re.fullmatch(pattern, name):
            hf = re.sub(pattern, template, name)
            conv1d = transposed and name.endswith(".weight") and ".h." in hf
            return HFTensor(hf, conv1d and not hf.split(".")[-2].startswith("ln_"))
    raise WeightsError(f"parameter {name} has no Hugging Face name")


def name_map(model: nn.Module) -> NameMap:
    """The map of an fxpar model: HFCausalLM, planner.models.presets.Llama or planner.models.presets.GPT."""
    from planner.models.hf import HFCausalLM
    from planner.models.presets import GPT, Llama
    first, alias = _first_names(model)
    if isinstance(model, HFCausalLM):
        def ref(n):
            return HFTensor(n.removeprefix("model."))
    elif isinstance(model, (Llama, GPT)):
        rules, gpt = (_GPT, True) if isinstance(model, GPT) else (_LLAMA, False)

        def ref(n):
            return _by_rules(n, rules, gpt)
    else:
        raise WeightsError(f"no Hugging Face name map for {type(model).__name__}: pretrained "
                           f"weights load into planner.models.hf models (planner.weights.hf_weights.hf_model(DIR)) "
                           f"and planner.models.presets GPT / Llama")
    return NameMap(tuple((n, ref(n)) for n in first), tuple(ref(n).name for n in alias))


# ---------------------------------------------------------------- the checkpoint directory


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory: tensor name -> (file, shape), read from the headers only."""

    folder: str
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, file, shape)

    def where(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: (file, shape) for name, file, shape in self.tensors}

    def describe(self) -> str:
        return os.path.join(self.folder, INDEX if self._indexed else SINGLE)

    @property
    def _indexed(self) -> bool:
        return os.path.exists(os.path.join(self.folder, INDEX))


def open_checkpoint(folder: str) -> Checkpoint:
    """The tensors of a Hugging Face checkpoint directory (headers only, nothing loaded)."""
    from safetensors import safe_open
    if not os.path.isdir(folder):
        raise WeightsError(f"weights directory {folder} does not exist; give a folder written "
                           f"by save_pretrained (with {SINGLE} or {INDEX})")
    files = _files(folder)
    tensors = []
    for file, names in files.items():
        path = os.path.join(folder, file)
        try:
            with safe_open(path, "pt") as f:
                present = set(f.keys())
                for name in names if names is not None else sorted(present):
                    if name not in present:
                        raise WeightsError(f"{path} has no tensor {name}, which {INDEX} "
                                           f"places there")
                    tensors.append((name, file, tuple(f.get_slice(name).get_shape())))
        except (OSError, RuntimeError) as err:   # safetensors: bad header, unreadable file
            raise WeightsError(f"cannot read {path}: {err}") from None
    return Checkpoint(folder, tuple(tensors))


def _files(folder: str) -> dict[str, list[str] | None]:
    """file -> the tensor names the index places in it (None: every tensor of the one file)."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise WeightsError(f"{index} is not a safetensors index with a weight_map: "
                               f"{err}") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if os.path.exists(os.path.join(folder, SINGLE)):
        return {SINGLE: None}
    raise WeightsError(f"{folder} holds neither {SINGLE} nor {INDEX}; give a folder written by "
                       f"save_pretrained")


def check_checkpoint(ckpt: Checkpoint, names: NameMap, shapes: Mapping[str, tuple[int, ...]]
                     ) -> None:
    """Every parameter's tensor present with its shape, and no tensor the model does not have
    (a tied alias may be present or not)."""
    where = ckpt.where()
    for name, ref in names.entries:
        want = ref.hf_shape(shapes[name])
        if ref.name not in where:
            raise WeightsError(f"{ckpt.describe()}: no tensor {ref.name} (expected shape "
                               f"{list(want)}, for parameter {name})")
        file, shape = where[ref.name]
        if tuple(shape) != want:
            raise WeightsError(f"{os.path.join(ckpt.folder, file)}: tensor {ref.name} has shape "
                               f"{list(shape)}, expected {list(want)} (parameter {name})")
    known = {ref.name for _, ref in names.entries} | set(names.aliases)
    for name, (file, shape) in where.items():
        if name not in known:
            raise WeightsError(f"{os.path.join(ckpt.folder, file)}: tensor {name} (shape "
                               f"{list(shape)}) is not a parameter of the model; give the "
                               f"checkpoint of this architecture and size")


def slice_ranges(spec: ShardSpec, size: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of dim spec.dim (full size `size`) that this shard takes, in
    order; a range past `size` is vocabulary padding (zeros)."""
    return spec.ranges(size)


def read_shard(handle, ref: HFTensor, spec: ShardSpec | None, shape: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of one parameter (full fxpar shape `shape`), reading only its slices."""
    view = handle.get_slice(ref.name)
    if spec is None:
        return ref.from_hf(view[:]).to(dtype)
    dim = (shape.__len__() - 1 - spec.dim) if ref.transpose else spec.dim
    size = shape[spec.dim]
    pieces = []
    for start, end in slice_ranges(spec, size):
        index = (slice(None),) * dim + (slice(start, min(end, size)),)
        piece = view[index]
        if end > size:   # vocabulary padding: zero rows, as ShardSpec.take appends them
            pad = list(piece.shape)
            pad[dim] = end - max(start, size)
            piece = torch.cat([piece, piece.new_zeros(pad)], dim)
        pieces.append(piece)
    return ref.from_hf(torch.cat(pieces, dim)).to(dtype)


class ShardReader:
    """A materialisation source (planner.weights.materialize.Source) reading a checkpoint per shard.
    Files are opened once and closed by `close()` (or a with block)."""

    def __init__(self, folder: str, model: nn.Module):
        self.names = name_map(model)
        self.ckpt = open_checkpoint(folder)
        params = dict(model.named_parameters())
        check_checkpoint(self.ckpt, self.names, {n: tuple(p.shape) for n, p in params.items()})
        self._dtypes = {n: p.dtype for n, p in params.items()}
        self._where = self.ckpt.where()
        self._handles: dict[str, object] = {}

    def __call__(self, name: str, spec: ShardSpec | None, shape: tuple[int, ...]) -> torch.Tensor:
        ref = self.names.to_hf(name)
        return read_shard(self._handle(self._where[ref.name][0]), ref, spec, shape,
                          self._dtypes[name])

    def _handle(self, file: str):
        from safetensors import safe_open
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.ckpt.folder, file), "pt")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def hf_model(folder: str):
    """The Hugging Face model of a checkpoint directory (its config.json), on the meta device:
    nothing allocated until each rank materialises its shard from the files."""
    from planner.models.hf import build_hf_from_file
    config = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise WeightsError(f"weights directory {folder} does not exist; give a folder written "
                           f"by save_pretrained")
    if not os.path.exists(config):
        raise WeightsError(f"{folder} has no config.json; give a folder written by "
                           f"save_pretrained")
    with torch.device("meta"):
        return build_hf_from_file(config)
