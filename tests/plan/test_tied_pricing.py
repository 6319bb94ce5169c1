"""A tied head on another stage than the embedding is priced: both hold the weight and the
all-reduce summing its gradients over their two ranks is on the critical path (runtime.training.tied)."""
import json

import pytest

from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.comm import collective_time
from planner.api import plan
from planner.models.presets import get_config

FIX = {"tp": 4, "dp": 4, "mb": 1, "strategy": "tp", "schedule": "1f1b"}


@pytest.mark.parametrize("pp", [1, 4])
def test_tied_head_adds_the_gradient_sum_across_the_end_stages(pp):
    untied, tied = (plan(get_config("gpt2-small", tie=t), 16 * pp, cluster="a100-80g-dgx",
                         fix={**FIX, "pp": pp})[0] for t in (False, True))
    extra = tied.predicted.iteration_s - untied.predicted.iteration_s
    if pp == 1:  # one stage holds one tensor: held, summed over dp and stepped once
        assert extra <= 1e-12
        assert tied.predicted.peak_memory_bytes < untied.predicted.peak_memory_bytes
        return
    config = get_config("gpt2-small")
    vocab_parallel = "vocab-tp" in tied.stages[0].strategies
    grad_bytes = config.vocab * config.hidden * 2 / (4 if vocab_parallel else 1)  # bf16
    expected = collective_time(get_cluster("a100-80g-dgx"), "all_reduce", grad_bytes, 2,
                               stride=(pp - 1) * 4 * 4)
    assert extra == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_ends_split_over_the_vocabulary_at_tp2(arch, capsys):
    """`fxpar plan --hf gpt2 --fix tp=2` splits the embedding and the head over the vocabulary as
    it does Llama's, once the vocabulary is large enough for the split to pay on cpu-gloo (at the
    small config's 256 it keeps both families' ends whole, by price): GPT-2 looks up
    wte(input_ids.view(-1, seq)), a re-shape passes.rewrite.vocab_parallel follows, and ties
    lm_head to wte, whose shard the embedding's price holds once (not the whole weight beside it:
    torch.export keeps the tie's second name as an unused get_attr)."""
    pytest.importorskip("transformers")
    from planner.api import _model_costs
    from planner.cli import main
    from planner.training.local import HFSpec, build

    vocab, hidden, positions = 32000, 64, 32
    assert main(["plan", "--hf", arch, "--gpus", "2", "--fix", "tp=2", "--cluster", "cpu-gloo",
                 "--vocab", str(vocab), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    ends = {layer: s for st in planned["stages"] for layer, s in zip(st["layers"],
                                                                    st["strategies"])
            if layer in ("embed", "head")}
    assert ends == {"embed": "vocab-tp", "head": "vocab-tp"}
    if arch != "gpt2":
        return
    model, batch = build(HFSpec("gpt2", global_batch=2, seq=positions,
                                overrides=(("vocab_size", vocab),)))
    costs = _model_costs(model, batch, None, None, fp32=True)[0]
    assert costs.tied_end_params == vocab * hidden
    embed = costs._end_profile("embed", 2)
    assert costs.vocab_errors == {}
    assert embed.params == vocab // 2 * hidden + positions * hidden  # wte's shard and wpe
