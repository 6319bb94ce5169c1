"""Vision-language families fxpar cannot train are refused in one line with their true cause
(an input its batch lacks, images that are not merged at image tokens, a config transformers
rejects at small sizes); BLIP-2, whose Q-Former makes a fixed count of tokens per image and
whose vision config states no channel count, is built and computes transformers' own loss."""
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


def test_a_q_former_family_is_refused_until_it_trains_exactly():
    """BLIP-2 plans, but its Q-Former's gradients differ from one process's from the second
    step under pipeline parallelism: refused in one line rather than trained wrong."""
    with pytest.raises(ValueError, match=r"Blip2ForConditionalGeneration passes its images "
                                         r"through a Q-Former, which fxpar does not train "
                                         r"exactly yet"):
        build_hf("blip-2")
