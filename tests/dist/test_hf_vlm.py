"""Vision-language Hugging Face families (planner.models.hf_vlm.FAMILIES: a vision tower, a
projector, a decoder), built small with no download: trained on 4 gloo ranks against one
process (losses, every gradient, the final parameters, rtol 1e-5) with the vision tower's blocks
and the decoder's split into one chain of pipeline stages; under tp=2 x pp=2 Llava (every block recomputed too), PaliGemma (a
vision block tp cannot split runs whole beside split ones) and Gemma 3 (a pooling projector), and
Llava under dp=2 x pp=2. Qwen2-VL and Qwen2.5-VL (planner.models.hf_qwen_vl: images of one grid,
M-RoPE positions as an input) under tp=2 x pp=2, Qwen2-VL's decoder sequence-parallel beside a
tower that is not. BLIP-2 (a Q-Former between the tower and the decoder) under tp=2 x pp=2,
dp=2 x pp=2 and dp=2 x tp=2. The other families of hf_vlm.FAMILIES train as exactly
(docs/models.md); the suite keeps these for its time."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.api import plan  # noqa: E402
from planner.models.hf import HFSpec  # noqa: E402
from planner.training.local import assert_same_run, build, reference_run, run_parallel  # noqa: E402,E501

TP = {"tp": 2, "pp": 2, "dp": 1, "mb": 2, "schedule": "1f1b", "strategy": "tp"}
# every block recomputed too: the merge of image features, in the vision tower's last block,
# stays in one stretch of the graph with it (Llava reads the next-to-last block's output)
TP_FULL = {**TP, "strategy": "tp+full"}
DP = {"dp": 2, "pp": 2, "tp": 1, "mb": 2, "schedule": "1f1b"}
# Gemma 3 scales its embeddings by sqrt(hidden): its projector's gradients reach ~80, where fp32
# summation order alone moves an element by 1e-5 (2e-7 of the largest)
ATOL = {"gemma3": 1e-4}


@pytest.mark.dist
@pytest.mark.parametrize("arch,fix", [("llava", TP_FULL), ("paligemma", TP), ("gemma3", TP),
                                      ("llava", DP), ("idefics3", {**TP, "strategy": "tp+sp"}),
                                      ("smolvlm", DP)],
                         ids=["llava-tp-full", "paligemma-tp", "gemma3-tp", "llava-dp",
                              "idefics3-tp-sp", "smolvlm-dp"])
def test_trains_like_one_process(pool4, arch, fix):
    spec = HFSpec(arch, global_batch=4)
    torch.manual_seed(0)
    model, batch = build(spec)
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    names = [layer for stage in chosen.stages for layer in stage.layers]
    vision = [n for n in names if "vision" in n]
    assert vision and names.index(vision[-1]) < len(names) - 2, names  # blocks of both parts
    parallel = run_parallel(spec, chosen, 2, pool4)
    assert_same_run(parallel, reference_run(spec, 2), atol=ATOL.get(arch, 1e-6),
                    what=f"{arch} tp={chosen.tp} dp={chosen.dp}")


@pytest.mark.dist
@pytest.mark.parametrize("arch,fix", [("qwen2_vl", {**TP, "strategy": "tp+sp"}),
                                      ("qwen2_5_vl", TP)],
                         ids=["qwen2_vl-tp-sp", "qwen2_5_vl-tp"])
def test_qwen_vl_trains_like_one_process(pool4, arch, fix):
    """Each micro-batch carries its samples' pixels ([batch, patches, ...]) and M-RoPE
    positions ([batch, 3, seq]); the vision blocks (Qwen2.5-VL's windowed one among them) and
    the decoder's are split by tp, the chain cut between them."""
    spec = HFSpec(arch, global_batch=4)
    torch.manual_seed(0)
    model, batch = build(spec)
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    first, last = chosen.stages[0].layers, chosen.stages[-1].layers
    assert any("visual" in n for n in first) and any("language_model" in n for n in last), chosen
    blocks = [x for stage in chosen.stages for n, x in zip(stage.layers, stage.strategies)
              if n not in ("embed", "head")]
    # blocks take sequence parallelism where asked, but for the vision tower's last (its merger
    # groups neighbouring patches, across the sequence's cut): that one runs tp alone
    asked = fix["strategy"]
    assert blocks == [asked, "tp", asked, asked], chosen
    parallel = run_parallel(spec, chosen, 2, pool4)
    assert_same_run(parallel, reference_run(spec, 2), what=f"{arch} tp={chosen.tp} dp={chosen.dp}")


@pytest.mark.dist
@pytest.mark.parametrize("fix", [TP, DP, {"dp": 2, "tp": 2, "pp": 1, "mb": 1, "strategy": "tp"}],
                         ids=["tp-pp", "dp-pp", "dp-tp"])
def test_blip2_trains_like_one_process(pool4, fix):
    """The Q-Former's blocks, a third part of the chain: its learned query tokens (read by the
    first of them only) cross-attend to the vision tower's features, and its output is merged
    at the image tokens; under pp the chain is cut after a vision or Q-Former block."""
    spec = HFSpec("blip-2", global_batch=4)
    torch.manual_seed(0)
    model, batch = build(spec)
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    names = [layer for stage in chosen.stages for layer in stage.layers]
    parts = ["vision_model"] * 2 + ["qformer"] * 2 + ["language_model"] * 2
    assert [n.split(".")[1] for n in names[1:-1]] == parts, names
    if fix.get("strategy") == "tp":  # the Q-Former's last block too: its projection gathered
        assert [s for st in chosen.stages for s in st.strategies][1:-1] == ["tp"] * 6, chosen
    parallel = run_parallel(spec, chosen, 3, pool4)
    assert_same_run(parallel, reference_run(spec, 3),
                    what=f"blip-2 tp={chosen.tp} dp={chosen.dp} pp={chosen.pp}")
