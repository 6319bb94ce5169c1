"""No rank holds the whole model: meta-device models materialised per shard, and Hugging Face
checkpoints read per shard, trained on gloo ranks against one process.

Ground truth: for a preset, the same meta model materialised whole in one process by the same
init rule (planner.weights.materialize.materialize_full); for a checkpoint, transformers' own
from_pretrained — its loss on the batch, then two training steps (losses, every gradient, final
parameters)."""
import dataclasses

import pytest
import torch
from conftest import rank_pool

from planner.models.presets import get_config
from planner.training.pretrained import Source, plan_for, run_parallel, train_one_process
from planner.training.local import assert_same_run


def _vocab_parallel(plan):
    """The plan with its embedding and head vocabulary-parallel (the planner keeps them whole
    on cpu-gloo at these sizes), so the vocabulary slices are read and initialised too."""
    ends = {"embed", "head"}
    stages = tuple(dataclasses.replace(st, strategies=tuple(
        "vocab-tp" if layer in ends else s for layer, s in zip(st.layers, st.strategies)))
        for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def _fixed(source, gpus, dp, tp, pp, cp=1, vocab=True):
    fix = dict(dp=dp, tp=tp, pp=pp, cp=cp, mb=2, strategy="tp", schedule="1f1b")
    plan = plan_for(source, gpus, fix)
    assert (plan.dp, plan.tp, plan.pp, plan.cp) == (dp, tp, pp, cp)
    return _vocab_parallel(plan) if vocab else plan


PRESETS = [  # (config, mesh): grouped-query heads and a prime vocabulary; a tied GPT; ring
    # attention (its position table made on the meta device)
    (get_config("llama-tiny").with_(layers=4, vocab=251), (1, 2, 2)),
    (get_config("gpt-tiny").with_(layers=4, tie=True), (2, 2, 2)),
    (get_config("llama-tiny").with_(layers=4), (1, 2, 2, 2)),
]


@pytest.mark.dist
@pytest.mark.parametrize("config,mesh", PRESETS, ids=["llama-tp2-pp2", "gpt-tied-dp2-tp2-pp2",
                                                       "llama-tp2-pp2-cp2"])
def test_meta_model_materialised_per_shard_matches_one_process(config, mesh):
    source = Source(config=config, global_batch=8, seed=7)
    gpus = mesh[0] * mesh[1] * mesh[2] * (mesh[3] if len(mesh) > 3 else 1)
    plan = _fixed(source, gpus, *mesh)
    parallel = run_parallel(source, plan, 2, rank_pool(gpus))
    assert_same_run(parallel, train_one_process(source, 2), what=config.name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Hugging Face Llama (grouped-query heads, tied embeddings; saved in several shards
    with an index) and GPT-2 (fused c_attn in Conv1D layout, tied head), via save_pretrained."""
    pytest.importorskip("transformers")
    from planner.models.hf import build_hf
    folders = {}
    torch.manual_seed(0)
    llama = build_hf("llama", num_hidden_layers=4, tie_word_embeddings=True, vocab_size=254)
    folders["llama"] = tmp_path_factory.mktemp("llama")
    llama.model.save_pretrained(folders["llama"], max_shard_size="100KB")
    gpt2 = build_hf("gpt2", n_layer=4)
    folders["gpt2"] = tmp_path_factory.mktemp("gpt2")
    gpt2.model.save_pretrained(folders["gpt2"])
    return {k: str(v) for k, v in folders.items()}


@pytest.mark.dist
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mesh", [(1, 2, 2), (2, 2, 2)], ids=["tp2-pp2", "dp2-tp2-pp2"])
def test_pretrained_weights_read_per_shard(checkpoints, arch, mesh):
    source = Source(weights=checkpoints[arch], global_batch=8)
    gpus = mesh[0] * mesh[1] * mesh[2]
    # the ends vocabulary-parallel: each rank reads its rows of the embedding and the head
    # (GPT-2's one tied weight) from the checkpoint
    plan = _fixed(source, gpus, *mesh)
    parallel = run_parallel(source, plan, 2, rank_pool(gpus))
    reference = train_one_process(source, 2)   # transformers' from_pretrained
    torch.testing.assert_close(parallel.losses[0], reference.losses[0], rtol=1e-5, atol=0,
                               msg=lambda m: f"the checkpoint's own loss: {m}")
    assert_same_run(parallel, reference, what=f"{arch} {mesh}")
