"""Vision-language models plan as two parts of one chain: the vision tower's blocks, then the
decoder's, each block with its own strategy; what cannot be captured or split is refused with
its cause."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.api import plan  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.models.hf import HFSpec, build_hf  # noqa: E402
from planner.search.costs import PlanningError  # noqa: E402
from planner.training.local import build  # noqa: E402
from passes.capture.trace import capture  # noqa: E402


def _llava():
    torch.manual_seed(0)
    return build(HFSpec("llava", global_batch=4))


def test_the_vision_tower_and_the_decoder_are_parts_of_one_chain():
    model, batch = _llava()
    captured = capture(model, tuple(x[:1] for x in batch))
    assert [p.rsplit(".", 2)[-2] for p in captured.parts] == ["encoder", "language_model"]
    names = [layer.name for layer in captured.layers]
    assert names[0] == "embed" and names[-1] == "head"
    assert [n.split(".")[2] for n in names[1:-1]] == ["vision_tower"] * 2 + ["language_model"] * 2
    # the merge of image features goes with the vision block whose output it reads
    merge = next(n.name for n in captured.gm.graph.nodes if "masked_scatter" in str(n.target))
    assert captured.layer_of()[merge].startswith("model.model.vision_tower")


def test_the_plan_prints_each_part():
    model, batch = _llava()
    text = str(plan(model, 4, batch, cluster="cpu-gloo",
                    fix={"tp": 2, "pp": 2, "dp": 1, "mb": 2, "strategy": "tp"})[0])
    assert "part" in text and "vision_tower" in text and "language_model" in text
    row = next(line for line in text.splitlines() if line.startswith("language_model "))
    assert "tp=2" in row


def test_a_sample_with_another_count_of_image_tokens_is_refused_at_its_step():
    model, (tokens, images, targets) = _llava()
    tokens = tokens.clone()
    tokens[0, 1] = 3  # one image token fewer in the first sample
    with pytest.raises(RuntimeError, match="every sample must hold 16 image tokens"):
        model(tokens, images, targets)


def test_context_parallel_is_refused_at_the_merge():
    model, batch = _llava()
    with pytest.raises(PlanningError, match="masked_scatter"):
        plan(model, 4, batch, cluster="cpu-gloo", fix={"cp": 2, "pp": 2, "dp": 1, "tp": 1})


def test_a_block_kind_tp_cannot_split_runs_whole_beside_tensor_parallel_ones():
    """PaliGemma's last vision block carries SigLIP's pooling head, whose norm meets a sharded
    feature dimension under tp: that block runs whole on the tp ranks, the others split."""
    torch.manual_seed(0)
    model, batch = build(HFSpec("paligemma", global_batch=4))
    chosen = plan(model, 4, batch, cluster="cpu-gloo",
                  fix={"tp": 2, "pp": 2, "dp": 1, "mb": 2, "strategy": "tp"})[0]
    strategies = dict(zip((l for s in chosen.stages for l in s.layers),
                          (x for s in chosen.stages for x in s.strategies)))
    assert strategies["model.model.vision_tower.encoder.layers.1"] == "none"
    assert strategies["model.model.language_model.layers.0"] == "tp"
    assert any("run whole on every rank of the tp group" in n for n in chosen.notes)


@pytest.mark.parametrize("arch,cause", [("llava_next", "image_sizes"),
                                        ("idefics2", "pixel_attention_mask")])
def test_families_whose_images_make_value_shaped_tokens_are_refused(arch, cause):
    with pytest.raises(ValueError, match=f"encodes its images with {cause}.*fixed number"):
        with torch.device("meta"):
            build_hf(arch)


def _qwen2_vl():
    torch.manual_seed(0)
    return build(HFSpec("qwen2_vl", global_batch=4))


def test_qwen2_vl_plans_with_images_of_one_grid_as_two_parts():
    """Its images' grid (image_grid_thw) is fixed by the image size: the vision tower's blocks
    and the decoder's make one chain, each tensor-parallel, the merge with the last vision
    block; the M-RoPE positions are an input, [batch, 3, seq]."""
    model, batch = _qwen2_vl()
    assert [tuple(x.shape) for x in batch] == [(4, 32), (4, 16, 96), (4, 3, 32), (4, 32)]
    captured = capture(model, tuple(x[:1] for x in batch))
    assert [p.rsplit(".", 2)[-2] for p in captured.parts] == ["visual", "language_model"]
    merge = next(n.name for n in captured.gm.graph.nodes if "masked_scatter" in str(n.target))
    assert captured.layer_of()[merge] == "model.model.visual.blocks.1"
    chosen = plan(model, 4, batch, cluster="cpu-gloo",
                  fix={"tp": 2, "pp": 2, "dp": 1, "mb": 2, "strategy": "tp"})[0]
    strategies = [x for stage in chosen.stages for x in stage.strategies]
    assert strategies == ["none", "tp", "tp", "tp", "tp", "none"]
    assert any("images of 16x16 pixels" in note for note in chosen.notes)


def test_qwen2_vl_context_parallel_is_refused_at_the_merge():
    model, batch = _qwen2_vl()
    with pytest.raises(PlanningError, match="masked_scatter"):
        plan(model, 4, batch, cluster="cpu-gloo", fix={"cp": 2, "pp": 2, "dp": 1, "tp": 1})


def test_a_qwen2_vl_7b_config_plans_per_part_on_64_gpus(capsys):
    """The published config.json names no image size: 448x448 images, 256 tokens each."""
    assert main(["plan", "--hf-config", "examples/configs/qwen2-vl-7b.json", "--gpus", "64",
                 "--cluster", "h100-sxm-dgx", "--seq", "2048", "--global-batch", "128",
                 "--fix", "pp=2"]) == 0
    out = capsys.readouterr().out
    assert "8.29B parameters" in out
    assert "images of 448x448 pixels: 32x32 patches, 256 image tokens" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("visual ", "language_model "))}
    assert rows["visual"][1] == "32" and rows["language_model"][1] == "28"
    assert rows["visual"][2].startswith("0")  # the tower first, the decoder after it
    assert int(rows["language_model"][2].split("-")[-1]) >= 1


def test_a_llava_7b_config_plans_per_part_on_64_gpus(capsys):
    assert main(["plan", "--hf-config", "examples/configs/llava-1.5-7b.json", "--gpus", "64",
                 "--cluster", "h100-sxm-dgx", "--seq", "2048", "--global-batch", "128",
                 "--fix", "pp=2"]) == 0
    out = capsys.readouterr().out
    assert "7.06B parameters" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("vision_tower ", "language_model "))}
    assert rows["vision_tower"][1] == "24" and rows["language_model"][1] == "32"
    assert rows["vision_tower"][2].startswith("0")  # the tower first, the decoder after it
    assert int(rows["language_model"][2].split("-")[-1]) >= 1


def test_a_transformers_model_given_as_it_is_plans_with_its_loss_function():
    """The raw LlavaForConditionalGeneration with loss_fn=causal_lm_loss: its data-dependent
    count of image tokens is replaced for the capture, as for HFVisionLM."""
    from planner.models.loss import causal_lm_loss
    model, (tokens, images, targets) = _llava()
    chosen = plan(model.model, 4, (tokens, images, targets), cluster="cpu-gloo",
                  loss_fn=causal_lm_loss)[0]
    assert any("language_model" in layer for stage in chosen.stages for layer in stage.layers)


def test_blip2_plans_its_q_former_as_a_third_part_between_the_tower_and_the_decoder():
    """BLIP-2 hands get_placeholder_mask no features: its count per image is the Q-Former's
    num_query_tokens (16 at the small sizes)."""
    torch.manual_seed(0)
    model, batch = build(HFSpec("blip-2", global_batch=4))
    chosen = plan(model, 4, batch, cluster="cpu-gloo",
                  fix={"tp": 2, "pp": 2, "dp": 1, "mb": 2, "strategy": "tp"})[0]
    parts = [line.split()[0] for line in str(chosen).splitlines()
             if line.startswith(("vision_model ", "qformer ", "language_model "))]
    assert parts == ["vision_model", "qformer", "language_model"], str(chosen)
