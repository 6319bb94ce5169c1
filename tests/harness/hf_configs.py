"""Hugging Face config.json files written for a test, and the model facts fxpar reads from them
(planner.interop.model_facts) on the meta device."""
from __future__ import annotations

import json

import torch


def config_file(tmp_path, small: dict, data: dict) -> str:
    """`data` over the test's `small` sizes, written as <model_type>.json; its path."""
    path = tmp_path / f"{data['model_type']}.json"
    small = {k: v for k, v in small.items()  # GPT-2 names its positions n_positions
             if not (k == "max_position_embeddings" and "n_positions" in data)}
    path.write_text(json.dumps({**small, **data}))
    return str(path)


def hf_facts(tmp_path, small: dict, data: dict, seq: int = 64):
    from planner.interop.model_facts import facts_of_hf
    from planner.models.hf import build_hf_from_file
    with torch.device("meta"):
        model = build_hf_from_file(config_file(tmp_path, small, data))
    return facts_of_hf(model, seq)
