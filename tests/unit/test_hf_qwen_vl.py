"""Qwen2-VL and Qwen2.5-VL on images of one fixed size: the static form fxpar captures computes
what transformers' own forward computes from image_grid_thw (the same loss and gradients, bit for
bit, in one process), and what does not fit that form is refused with its cause."""
import functools

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from planner.models import hf, hf_qwen_vl  # noqa: E402


def _small(arch, **overrides):
    torch.manual_seed(0)
    config = hf_qwen_vl.small_config(arch, functools.partial(hf.small_config, text_part=True),
                                     **overrides)
    return hf_qwen_vl.from_config(config)


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _transformers_loss(model, tokens, pixel_values, targets):
    """transformers' unpatched forward: grids given per image, positions from get_rope_index."""
    config = model.model.config
    grids = torch.tensor([model.grid] * tokens.shape[0])
    logits = model.model(input_ids=tokens, pixel_values=pixel_values.flatten(0, 1),
                         image_grid_thw=grids, use_cache=False,
                         mm_token_type_ids=(tokens == config.image_token_id).int()).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


# images wider than high, so that rows and columns of the grid differ; Qwen2.5-VL's 32x48 makes
# 2x3 windows of 4x4 patches
@pytest.mark.parametrize("arch,size", [("qwen2_vl", (16, 24)), ("qwen2_5_vl", (32, 48))])
def test_the_static_form_is_transformers_own_forward(arch, size):
    model = _small(arch, vision_image_size=list(size))
    tokens, pixels, positions, targets = model.example_inputs(
        3, 32, generator=torch.Generator().manual_seed(0))
    loss = model(tokens, pixels, positions, targets)
    loss.backward()
    ours = _grads(model)
    reference = _transformers_loss(model, tokens, pixels, targets)
    reference.backward()
    theirs = _grads(model)
    assert loss.item() == reference.item()
    assert ours.keys() == theirs.keys() and len(ours) == len(list(model.parameters()))
    unequal = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not unequal, unequal


def test_the_positions_are_m_rope_positions_of_the_image_grid():
    model = _small("qwen2_vl", vision_image_size=[16, 24])   # 2x3 image tokens after 1 token
    tokens, _, positions, _ = model.example_inputs(2, 12, generator=torch.Generator())
    assert positions.shape == (2, 3, 12)
    assert positions[0, :, :7].tolist() == [[0, 1, 1, 1, 1, 1, 1],      # time
                                            [0, 1, 1, 1, 2, 2, 2],      # rows
                                            [0, 1, 2, 3, 1, 2, 3]]      # columns
    assert positions[0, :, 7:].tolist() == [list(range(4, 9))] * 3      # text after the image


def test_images_of_another_size_are_refused_at_the_call():
    model = _small("qwen2_vl")
    tokens, pixels, positions, targets = model.example_inputs(2, 32)
    with pytest.raises(ValueError, match=r"pixel_values has shape \[2, 20, 96\]; expected "
                                         r"\[2, 16, 96\]"):
        model(tokens, torch.zeros(2, 20, 96), positions, targets)
    with pytest.raises(ValueError, match=r"positions has shape \[3, 2, 32\]"):
        model(tokens, pixels, positions.permute(1, 0, 2), targets)


def test_a_sample_with_another_count_of_image_tokens_is_refused_at_its_step():
    model = _small("qwen2_vl")
    tokens, pixels, positions, targets = model.example_inputs(2, 32)
    tokens[1, 1] = 3
    with pytest.raises(RuntimeError, match="every sample must hold 4 image tokens"):
        model(tokens, pixels, positions, targets)


@pytest.mark.parametrize("arch,size,cause", [
    ("qwen2_vl", 18, "not a multiple of patch_size x spatial_merge_size = 8 pixels"),
    ("qwen2_5_vl", [40, 32], "not tiled by the attention windows of 16 pixels"),
    ("qwen2_vl", [16, 16, 16], r"image_size \[16, 16, 16\] is not a size in pixels"),
])
def test_image_sizes_off_the_grid_are_refused_at_build(arch, size, cause):
    with pytest.raises(ValueError, match=cause):
        _small(arch, vision_image_size=size)


def test_a_published_config_gets_448_pixel_images_without_an_image_size():
    with torch.device("meta"):
        model = hf.build_hf_from_file("examples/configs/qwen2-vl-7b.json")
    assert isinstance(model, hf_qwen_vl.HFQwenVisionLM)
    assert model.grid == (1, 32, 32) and model.image_tokens() == 256
    tokens, pixels, positions, targets = hf.example_inputs(model, 2, 300)
    assert pixels.shape == (2, 1024, 3 * 2 * 14 * 14) and positions.shape == (2, 3, 300)
