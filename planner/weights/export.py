"""`fxpar export`: a checkpoint saved under any plan (runtime.checkpoint.state) as one consolidated
safetensors file, under Hugging Face names when the model has them.

At save time `model_files(model)` describes the model for a later export, as small files rank 0
writes into the checkpoint folder: `hf-names.json` (fxpar full parameter name -> Hugging Face
tensor name and whether it is stored transposed, planner.weights.hf_weights.name_map) and, for a Hugging
Face model or a preset, its `config.json`. The export reads every parameter whole in one process (DCP joins
the pieces of whatever mesh saved them), renames and lays them out as Hugging Face does, and
writes FILE.safetensors; `config.json` goes beside it when its folder has none, so that
`transformers.AutoModelForCausalLM.from_pretrained(folder)` loads it.

A run in precision "bf16-main" (runtime.training.main_weights) holds bf16 weights and an fp32
main copy of each in its optimizer state (`optim/<name>/main`). The export writes the weights
as the model holds them (bf16, each the main copy rounded) and says the main copies are there;
`main_weights=True` (`--main-weights`) writes those fp32 copies instead.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import torch

NAMES = "hf-names.json"
CONFIG = "config.json"


class ExportError(ValueError):
    """A checkpoint or an output path an export cannot use."""


def model_files(model) -> dict[str, str]:
    """File name -> text describing `model` for an export: its Hugging Face name map and its
    config (a Hugging Face model's own, a preset's as GPT-2 or Llama); empty for a model with no
    Hugging Face names."""
    from planner.models.hf import HFCausalLM
    from planner.weights.hf_weights import WeightsError, name_map
    try:
        names = name_map(model)
    except WeightsError:
        return {}
    files = {NAMES: json.dumps({"names": {n: [ref.name, ref.transpose]
                                          for n, ref in names.entries},
                                "aliases": list(names.aliases)}, indent=1)}
    if isinstance(model, HFCausalLM):
        files[CONFIG] = model.model.config.to_json_string()
    elif getattr(getattr(model, "cfg", None), "experts", 1) == 0:  # a dense preset (GPT-2
        # or Llama names)
        files[CONFIG] = json.dumps(preset_config(model.cfg), indent=1)
    return files


def preset_config(cfg) -> dict:
    """The transformers config.json that builds the same model as an fxpar GPT / Llama preset
    (tests/unit/test_truthful_outputs.py loads an export with it and compares the loss): GPT-2
    with exact GELU, LayerNorm eps 1e-5 and an unbiased head; Llama with RMSNorm eps 1e-5,
    rotary base 10000 and no biases."""
    common = {"vocab_size": cfg.vocab, "tie_word_embeddings": cfg.tie,
              "bos_token_id": 0, "eos_token_id": 0}
    if cfg.arch == "gpt":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **common,
                "n_layer": cfg.layers, "n_embd": cfg.hidden, "n_head": cfg.heads,
                "n_inner": cfg.ffn_hidden, "n_positions": cfg.seq,
                "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
                "attn_pdrop": cfg.dropout}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common,
            "num_hidden_layers": cfg.layers, "hidden_size": cfg.hidden,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads,
            "intermediate_size": cfg.ffn_hidden, "max_position_embeddings": cfg.seq,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout}


def read_parameters(path: str, main_weights: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, whole, by fxpar full name (in this process); with
    `main_weights`, a parameter's fp32 main copy where the optimizer holds one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runtime.checkpoint.dcp_slices import SlicesLoadPlanner
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    keys = {key[len("model/"):]: key for key, md in metadata.items()
            if key.startswith("model/") and isinstance(md, TensorStorageMetadata)}
    if main_weights:
        keys = {name: _main_key(name, metadata) or key for name, key in keys.items()}
    state = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
             for key in keys.values()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it loads without a process group
        dcp.load(state, storage_reader=FileSystemReader(path), planner=SlicesLoadPlanner(),
                 no_dist=True)
    return {name: state[key] for name, key in keys.items()}


def _main_key(name: str, metadata: dict) -> str | None:
    from runtime.training.main_weights import MAIN_KEY
    key = f"optim/{name}/{MAIN_KEY}"
    return key if key in metadata else None


def main_copies(path: str) -> int:
    """How many parameters of a checkpoint have an fp32 main copy in its optimizer state."""
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(1 for key in metadata
               if key.startswith("model/") and _main_key(key[len("model/"):], metadata))


def hf_state(path: str, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The parameters under Hugging Face names and layouts, or None when the checkpoint has no
    name map."""
    names_file = os.path.join(path, NAMES)
    if not os.path.exists(names_file):
        return None
    with open(names_file) as f:
        names = json.load(f)["names"]
    missing = sorted(set(names) - set(params))
    if missing:
        raise ExportError(f"checkpoint {path} lacks parameters its name map lists: "
                          f"{', '.join(missing[:5])}")
    return {hf: (params[n].t().contiguous() if transpose else params[n])
            for n, (hf, transpose) in names.items()}


def export(checkpoint: str, out: str, main_weights: bool = False) -> tuple[str, int, bool]:
    """Write the checkpoint (a folder, or the latest complete one under it) to `out`
    (.safetensors), with `main_weights` the fp32 main copies of a "bf16-main" run. Returns (the
    checkpoint read, tensors written, whether under HF names)."""
    from safetensors.torch import save_file

    from runtime.checkpoint.state import resolve
    if not out.endswith(".safetensors"):
        raise ExportError(f"--out {out}: give a file name ending in .safetensors")
    path = resolve(checkpoint)
    if main_weights and not main_copies(path):
        raise ExportError(f"--main-weights: checkpoint {path} holds no fp32 main weights (only a "
                          f"run in precision bf16-main keeps them); export without it")
    params = read_parameters(path, main_weights)
    hf = hf_state(path, params)
    state = hf if hf is not None else params
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out, metadata={"format": "pt"})
    config = os.path.join(path, CONFIG)
    if os.path.exists(config) and not os.path.exists(os.path.join(folder, CONFIG)):
        shutil.copyfile(config, os.path.join(folder, CONFIG))
    return path, len(state), hf is not None


def cmd_export(args) -> int:
    path, count, hf = export(args.checkpoint, args.out, args.main_weights)
    print(export_line(args.out, path, count, hf, args.main_weights))
    return 0


def export_line(out: str, path: str, count: int, hf: bool, main_weights: bool) -> str:
    """What an export wrote, and the fp32 main weights it left in the checkpoint."""
    names = "Hugging Face names" if hf else "fxpar names (the model has no Hugging Face map)"
    line = f"wrote {out}: {count} tensors from {path}, under {names}"
    if main_weights:
        return line + "; the fp32 main weights of a bf16-main run"
    copies = main_copies(path)
    if copies:
        line += (f"; the weights as trained (bf16); the checkpoint also holds fp32 main weights "
                 f"of {copies} of them: --main-weights exports those")
    return line
