"""Encoder-decoder Hugging Face models (planner.models.hf_seq2seq) trained on 4 gloo ranks against
one process: losses of each step, every gradient, the final parameters (rtol 1e-5). The encoder's
and the decoder's blocks are split into pipeline stages (the encoder's output carried to the
decoder's stage); T5's relative position bias, made in the first block from a trained embedding and
read by every block, is read per rank under tensor parallelism (its gradient summed by tp_copy);
BART's cross-attention rings over the encoder's tokens under context parallelism."""
import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from planner.api import plan  # noqa: E402
from planner.models.hf_seq2seq import HFSeq2SeqSpec  # noqa: E402
from planner.training.local import assert_same_run, build, reference_run, run_parallel  # noqa: E402

MESHES = {"tp2-pp2": {"tp": 2, "pp": 2, "dp": 1, "cp": 1, "strategy": "tp"},
          "tp2-sp-pp2": {"tp": 2, "pp": 2, "dp": 1, "cp": 1, "strategy": "tp+sp"},
          "dp2-pp2": {"dp": 2, "pp": 2, "tp": 1, "cp": 1},
          "cp2-pp2": {"cp": 2, "pp": 2, "tp": 1, "dp": 1}}
# (arch, fields, mesh): T5 v1.0 with attention 128 wide (8 heads of 16) beside d_model 64;
# UMT5, a bias of its own in every block, attention 32 wide; LongT5, local attention over blocks
# of tokens as einsums over heads, the sequence padded to whole blocks.
RUNS = [("t5", (("d_kv", 16),), "tp2-pp2"), ("t5", (("d_kv", 16),), "dp2-pp2"),
        ("bart", (), "tp2-sp-pp2"), ("bart", (), "dp2-pp2"), ("bart", (), "cp2-pp2"),
        ("umt5", (("d_kv", 4),), "tp2-pp2"), ("longt5", (), "tp2-pp2")]


@pytest.mark.dist
@pytest.mark.parametrize("arch,fields,mesh", RUNS,
                         ids=[f"{arch}-{mesh}" for arch, _, mesh in RUNS])
def test_trains_like_one_process(pool4, arch, fields, mesh):
    spec = HFSeq2SeqSpec(arch, global_batch=8, overrides=fields, seq=16)
    torch.manual_seed(0)
    model, batch = build(spec)
    fix = {**MESHES[mesh], "mb": 2, "schedule": "1f1b"}
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    assert (chosen.tp, chosen.pp, chosen.dp, chosen.cp) == \
        (fix["tp"], fix["pp"], fix["dp"], fix["cp"])
    stages = [" ".join(stage.layers) for stage in chosen.stages]
    assert "encoder" in stages[0] and "decoder" in stages[-1]  # one part on each stage
    parallel = run_parallel(spec, chosen, 2, pool4)
    assert_same_run(parallel, reference_run(spec, 2), what=f"{arch} {mesh}")


@pytest.mark.dist
def test_values_crossing_several_stages_train_like_one_process(pool4):
    """T5 with 2 encoder and 3 decoder blocks on 4 stages, [embed, encoder 0 | encoder 1,
    decoder 0 | decoder 1 | decoder 2, head]: the encoder's position bias crosses from stage 0,
    the decoder's and the encoder's output from stage 1 through stage 2 to stage 3 (whole, with
    their gradients coming back the same way)."""
    spec = HFSeq2SeqSpec("t5", global_batch=8, overrides=(("num_decoder_layers", 3),), seq=16)
    torch.manual_seed(0)
    model, batch = build(spec)
    fix = {"pp": 4, "tp": 1, "dp": 1, "cp": 1, "mb": 2, "schedule": "1f1b"}
    chosen = _restaged(plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0], (2, 2, 1, 2))
    assert [len(s.layers) for s in chosen.stages] == [2, 2, 1, 2]
    assert chosen.stages[1].layers == ("model.encoder.block.1", "model.decoder.block.0")
    parallel = run_parallel(spec, chosen, 2, pool4)
    assert_same_run(parallel, reference_run(spec, 2), what="t5 pp4")


def _restaged(chosen, sizes: tuple[int, ...]):
    """The plan with its layers regrouped into stages of `sizes` layers (prices left as they
    are: only the layout runs)."""
    layers = [(layer, s) for stage in chosen.stages for layer, s in zip(stage.layers,
                                                                       stage.strategies)]
    stages, start = [], 0
    for size in sizes:
        part = layers[start:start + size]
        stages.append(dataclasses.replace(chosen.stages[0], layers=tuple(x for x, _ in part),
                                          strategies=tuple(s for _, s in part)))
        start += size
    assert start == len(layers)
    return dataclasses.replace(chosen, stages=tuple(stages))
