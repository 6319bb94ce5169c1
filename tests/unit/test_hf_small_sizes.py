"""Every family build_hf accepts is built at fxpar's small sizes in all its parts (a text_config,
a vision_config, a VQ-VAE beside the decoder), or refused in one line: none is built silently at
its published size, as Emu3 was while its text sizes lay in a text_config the top-level sizes
missed."""
import pytest
import torch

pytest.importorskip("transformers")

from planner.models import hf, hf_seq2seq, hf_vlm  # noqa: E402

# A family at the small sizes holds at most this many parameters (the largest, with hundreds of
# small experts, about 16M); the smallest published model of any of them holds several times more.
LIMIT = 20_000_000


def _families() -> list[str]:
    """Every name build_hf accepts: decoder-only, vision-language and encoder-decoder."""
    return sorted(set(hf.architectures()) | set(hf_vlm.architectures())
                  | set(hf_seq2seq.architectures()))


def _built_or_refused(arch: str):
    """(parameters, None) of `arch` built on the meta device, or (None, refusal text)."""
    try:
        with torch.device("meta"):
            model = hf.build_hf(arch)
    except ValueError as err:
        return None, str(err)
    return sum(p.numel() for p in model.parameters()), None


def test_every_family_is_small_or_refused_in_one_line():
    large, unclear, built = {}, {}, 0
    for arch in _families():
        count, refusal = _built_or_refused(arch)
        if refusal is not None:
            if "\n" in refusal or not refusal.strip():
                unclear[arch] = refusal
        elif count > LIMIT:
            large[arch] = count
        else:
            built += 1
    assert not large, f"built above {LIMIT:,} parameters: {large}"
    assert not unclear, f"refused without a one-line reason: {unclear}"
    assert built > 100  # most families build; a refusal of all of them would pass the above


def test_emu3_text_and_vq_configs_are_small():
    config = hf.small_config("emu3")
    text, vq = config.text_config, config.vq_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (64, 2, 256)
    assert text.intermediate_size == 128 and text.attention_dropout == 0.0
    assert max(text.bos_token_id, text.eos_token_id, text.pad_token_id) < 256
    assert vq.codebook_size == 256 and vq.base_channels == 32
    with torch.device("meta"):
        model = hf.build_hf("emu3")
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_overrides_reach_the_part_that_holds_the_field():
    """A size applies to every part; any other field goes where the family keeps it (Emu3's
    rms_norm_eps in its text_config), a field of the top config stays there."""
    config = hf.small_config("emu3", num_hidden_layers=3, rms_norm_eps=1e-3,
                             tie_word_embeddings=True)
    assert config.text_config.num_hidden_layers == 3
    assert config.text_config.rms_norm_eps == 1e-3
    assert config.tie_word_embeddings is True


@pytest.mark.parametrize("arch,part", [("git", "vision_config"), ("blt", "global_config"),
                                       ("phi4_multimodal", "audio_config"),
                                       ("gemma4_unified_assistant", "text_config")])
def test_parts_beside_the_decoder_are_small(arch, part):
    config = hf.small_config(arch)
    assert getattr(config, part).hidden_size == 64


def test_a_family_transformers_cannot_build_small_is_refused_in_one_line():
    """DBRX's attention config lacks a field its model reads at any size: what transformers
    raises is said in one line naming the family and what to give instead."""
    with pytest.raises(ValueError, match=r"^dbrx: transformers cannot build it at fxpar's "
                                         r"small sizes \(.*\); plan its config.json with "
                                         r"--hf-config$"):
        hf.build_hf("dbrx")


@pytest.mark.parametrize("layers", [2, 3])
def test_gpt_neo_repeats_its_attention_pattern_to_the_small_layer_count(layers):
    """GPT-Neo lists its global/local attention pattern per layer; transformers refuses a pattern
    of another length, so the small sizes repeat it to the layer count."""
    model = hf.build_hf("gpt_neo", num_hidden_layers=layers)
    assert len(model.model.config.attention_layers) == layers
