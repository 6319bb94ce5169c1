"""Vision-language families fxpar cannot train are refused in one line with their true cause
(an input its batch lacks, images that are not merged at image tokens, a config transformers
rejects at small sizes); BLIP-2, whose Q-Former makes a fixed count of tokens per image and
whose vision config states no channel count, is built with its query tokens drawn and computes
transformers' own loss (tests/dist/test_hf_vlm.py trains it exactly on ranks)."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from planner.models import hf_vlm  # noqa: E402
from planner.models.hf import build_hf, small_config  # noqa: E402


def _refusal(arch: str) -> str:
    with pytest.raises(ValueError) as err:
        with torch.device("meta"):
            build_hf(arch)
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("arch,cause", [
    ("instructblip", "needs qformer_input_ids (the Q-Former's instruction tokens) beside "
                     "pixel_values"),
    ("deepseek_vl_hybrid", "needs high_res_pixel_values"),
    ("kosmos-2", "places them by the input mask image_embeds_position_mask"),
    ("mllama", "its decoder cross-attends to them in its cross_attention_layers"),
    ("instructblipvideo", "it encodes videos through get_video_features, not images"),
])
def test_a_family_fxpar_cannot_feed_is_refused_with_its_cause(arch, cause):
    text = _refusal(arch)
    assert cause in text, text
    # an input fxpar does not make sets no count of tokens: not the value-shaped refusal
    assert "decide how many tokens" not in text and "AttributeError" not in text, text


def test_families_that_do_not_merge_at_image_tokens_say_what_is_supported():
    text = _refusal("mllama")
    assert "does not merge image features into the token embeddings at image tokens" in text
    assert "llava" in text and "get_image_features" not in text


def test_granite_docling_s_projector_width_follows_the_small_text_model():
    text = hf_vlm.small_config("granite_docling", _text)
    assert text.vision_config.out_hidden_size == text.text_config.hidden_size == 64


def test_a_config_transformers_rejects_is_one_line_naming_the_family_and_the_field():
    with pytest.raises(ValueError) as err:
        hf_vlm.small_config("granite_docling", _text, vision_out_hidden_size=1024)
    text = str(err.value)
    assert text.startswith("granite_docling: transformers rejects the family's config")
    assert "vision_config.out_hidden_size (1024)" in text and "\n" not in text, text


def _text(model_type, **fields):
    return small_config(model_type, text_part=True, **fields)


def test_blip2_images_make_its_query_tokens_and_the_loss_is_transformers_own():
    torch.manual_seed(0)
    model = build_hf("blip-2")
    assert model.image_shape(2) == (2, 3, 16, 16)  # Blip2VisionConfig states no num_channels
    assert model.image_tokens() == model.model.config.num_query_tokens == 16
    tokens, pixels, targets = model.example_inputs(2, 32,
                                                   generator=torch.Generator().manual_seed(0))
    logits = model.model(input_ids=tokens, pixel_values=pixels, use_cache=False).logits
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert torch.equal(model(tokens, pixels, targets), ref)
    tokens[0, 1] = 3  # one image token fewer in the first sample
    with pytest.raises(RuntimeError, match="every sample must hold 16 image tokens"):
        model(tokens, pixels, targets)


def test_blip2_s_query_tokens_are_drawn_not_left_at_zero():
    """transformers starts the query tokens at zero: the Q-Former's first layer norm would see
    rows of zero variance and scale their gradient by 1/sqrt(eps), 1e6, and the model would
    train to NaN in one process. Drawn like the other weights, biases left at zero."""
    torch.manual_seed(0)
    model = build_hf("blip-2").model
    queries = model.query_tokens
    std = model.config.initializer_range
    assert queries.count_nonzero() == queries.numel()
    assert 0.5 * std < float(queries.std()) < 2 * std
    assert float(queries.var(-1).min()) > 0  # every row normalizes with a variance of its own
    assert not model.vision_model.encoder.layers[0].mlp.fc1.bias.count_nonzero()
