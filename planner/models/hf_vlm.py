"""Vision-language Hugging Face models: a vision tower, a projector and a decoder (Llava and the
families built like it), trained on (tokens, images, targets).

transformers merges the image features into the token embeddings where the tokens hold the
image token: `inputs_embeds.masked_scatter(mask, image_features)` after
`get_placeholder_mask`, which checks that the whole batch holds as many image tokens as there
are features - a count read from the tokens' values, a data-dependent step fxpar cannot capture
on fake tensors. `fixed_image_merge` replaces that check by one the graph keeps
(`torch._assert_async`, run on the real tokens at every step): every sample holds the same
number of image tokens, its share of the features. That is also what makes the merge exact
under data and pipeline parallelism: masked_scatter fills the mask's positions in order, and a
micro-batch of whole samples, with its own samples' images, fills them as the whole batch would.
Under context parallelism a rank holds part of each sequence and would fill its image tokens
from the first features: refused (passes.rewrite.context_parallel, `masked_scatter`).

The vision tower's blocks and the decoder's are two parts of one chain (passes.capture.trace):
each block gets its own strategy, and the stages split the chain wherever the search puts them.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import torch
import torch.nn.functional as F

from planner.models import hf_idefics, hf_small
from planner.models.hf_wrapper import HFWrapper, transformers_module as _transformers

# The vision tower at sizes that train on CPU ranks: 16x16 images of 4x4 patches (16 per image)
VISION_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, image_size=16, patch_size=4)


def architectures() -> list[str]:
    """The model_types of image-text-to-text models whose merge fxpar rewrites (they fill the
    image tokens' embeddings through `get_placeholder_mask`)."""
    tf = _transformers()
    mapping = tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    return sorted(t for t, cls in tf.CONFIG_MAPPING.items() if cls in mapping
                  and (hasattr(_base_model_class(tf, cls), "get_placeholder_mask")
                       or t in hf_idefics.MODEL_TYPES))


@functools.lru_cache(maxsize=None)
def is_vision_language_arch(arch: str) -> bool:
    """Whether `arch` is an image-text-to-text model of a vision tower and a text model (only
    its config's module is imported)."""
    tf = _transformers()
    if arch not in tf.CONFIG_MAPPING.keys():
        return False
    cls = tf.CONFIG_MAPPING[arch]
    return cls in tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and _has_parts(cls())


def _has_parts(config) -> bool:
    return hasattr(config, "vision_config") and hasattr(config, "text_config")


def is_vision_language(config) -> bool:
    tf = _transformers()
    return type(config) in tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and _has_parts(config)


def _base_model_class(tf, config_cls):
    return tf.MODEL_MAPPING.get(config_cls, type(None)) if config_cls in tf.MODEL_MAPPING \
        else type(None)


@contextlib.contextmanager
def fixed_image_merge(model: torch.nn.Module):
    """While active, every `get_placeholder_mask` of `model`'s modules checks per sample (in
    the graph) instead of over the batch (in Python, on the tokens' values), and Idefics 3 /
    SmolVLM encode whole images and merge through it (planner.models.hf_idefics)."""
    with hf_idefics.fixed_images(model, _placeholder_mask), _masks_by(model, _placeholder_mask):
        yield


@contextlib.contextmanager
def _masks_by(model: torch.nn.Module, method):
    """While active, `method` is the get_placeholder_mask of every class of `model`'s modules
    that has one."""
    owners = {type(m) for m in model.modules() if hasattr(type(m), "get_placeholder_mask")}
    saved = {cls: cls.get_placeholder_mask for cls in owners}
    for cls in owners:
        cls.get_placeholder_mask = method
    try:
        yield
    finally:
        for cls, saved_method in saved.items():
            cls.get_placeholder_mask = saved_method


def _placeholder_mask(self, input_ids, inputs_embeds=None, image_features=None, **_):
    if input_ids is None:
        raise ValueError("fxpar trains vision-language models from token ids (input_ids), "
                         "not from inputs_embeds: give the model input_ids")
    mask = input_ids == self.config.image_token_id
    per_sample = _image_tokens(self.config, inputs_embeds, image_features, input_ids.shape[0])
    if per_sample is not None:
        torch._assert_async((mask.sum(-1) == per_sample).all(),
                            f"every sample must hold {per_sample} image tokens (the features "
                            f"of its own images, one after another), as the example batch did")
    return mask.unsqueeze(-1).expand_as(inputs_embeds)


def _image_tokens(config, inputs_embeds, image_features, samples: int) -> int | None:
    """Image tokens per sample: the features' rows shared among the samples, or, where the family
    does not hand its features to get_placeholder_mask (BLIP-2), its Q-Former's query tokens -
    it makes num_query_tokens of every image. None where neither says."""
    if image_features is not None:
        return image_features.numel() // (inputs_embeds.shape[-1] * samples)
    queries = getattr(config, "num_query_tokens", None)
    return queries if isinstance(queries, int) else None


class HFVisionLM(HFWrapper):
    """(tokens, pixel_values, targets) -> the mean cross-entropy of every position against its
    target, the next token (image positions included: give them the loss's ignore index -100
    to leave them out)."""

    def __init__(self, model: torch.nn.Module):
        with hf_idefics.fixed_images(model, _placeholder_mask):
            _check_fixed_images(model)
        super().__init__(model)

    def forward(self, tokens, pixel_values, targets):
        from planner.models.hf_attention import plain_positions
        with fixed_image_merge(self.model), plain_positions():
            logits = self.model(input_ids=tokens, pixel_values=pixel_values,
                                use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               ignore_index=-100)

    def image_tokens(self) -> int:
        """Image tokens per image: what the vision tower and projector make of one image
        (patches, less a class token, merged or pooled by the projector), counted on fake
        tensors."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        counted: list[int] = []
        config = self.model.config
        device = next(self.model.parameters()).device  # meta for a model without weights
        shape = self.image_shape(1)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), \
                    hf_idefics.fixed_images(self.model, _placeholder_mask), \
                    _counting(self.model, counted):
                tokens = torch.full((1, 2), config.image_token_id, dtype=torch.long,
                                    device=device)
                self.model(input_ids=tokens, use_cache=False,
                           pixel_values=torch.zeros(shape, device=device))
        except Exception as err:  # noqa: BLE001 - any failure of the family's own code
            first = " ".join(str(err).split())[:200] or type(err).__name__
            raise ValueError(f"{type(self.model).__name__} does not encode an image of shape "
                             f"{list(shape)} as pixel_values on fake tensors "
                             f"({type(err).__name__}: {first}); fxpar trains vision-language "
                             f"models whose images make a fixed number of tokens "
                             f"({', '.join(FAMILIES)})") from None
        if not counted:
            raise ValueError(f"{type(self.model).__name__} did not merge image features "
                             f"through get_placeholder_mask: fxpar cannot place its image "
                             f"tokens; it trains families that do ({', '.join(FAMILIES)})")
        return counted[0]

    def image_shape(self, batch: int) -> tuple[int, ...]:
        vision = self.model.config.vision_config
        size = getattr(vision, "image_size", None)
        if size is None:
            raise ValueError(f"{type(self.model).__name__}'s vision config "
                             f"({type(vision).__name__}) states no image_size: its images may "
                             f"be of any size, which fxpar cannot capture as a shape; it trains "
                             f"vision-language models of fixed-size images "
                             f"({', '.join(FAMILIES)})")
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return (batch, getattr(vision, "num_channels", 3), height, width)

    def example_inputs(self, batch: int, seq: int, device="cpu",
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """Random tokens with one image's tokens after the first token of each sample, random
        images, targets with the image positions left out (-100)."""
        config, count = self.model.config, self.image_tokens()
        if seq < count + 2:
            raise ValueError(f"a sequence of {seq} tokens cannot hold an image of {count} "
                             f"tokens and text: give --seq of at least {count + 2}")
        image_id, vocab = config.image_token_id, config.text_config.vocab_size
        shape, images = (batch, seq), self.image_shape(batch)
        if str(device) == "meta":
            tokens = torch.zeros(shape, dtype=torch.long, device="meta")
            return tokens, torch.zeros(images, device="meta"), tokens
        tokens = torch.randint(0, vocab - 1, shape, generator=generator)
        tokens = torch.where(tokens >= image_id, tokens + 1, tokens) % vocab
        tokens[:, 1:1 + count] = image_id
        targets = torch.randint(0, vocab, shape, generator=generator)
        targets[:, :1 + count] = -100
        return tokens, torch.randn(images, generator=generator), targets


def _check_fixed_images(model: torch.nn.Module) -> None:
    """Refuses, before any tracing, the families fxpar cannot feed or place: image encoders
    that need inputs beside pixel_values - values that decide how many tokens an image makes
    (image_sizes: LLaVA-NeXT's tiles; image_grid_thw: GLM-4V's images of any size, Qwen2-VL's
    train at one size in planner.models.hf_qwen_vl; pixel_attention_mask: Idefics 2, Idefics 3
    and SmolVLM's whole at one size in planner.models.hf_idefics), or data
    fxpar's batch does not hold (InstructBLIP's Q-Former instruction tokens) - and images that
    do not reach the decoder as features merged at image tokens (_check_merged)."""
    encode = getattr(model.base_model, "get_image_features", None)
    taken = inspect.signature(encode).parameters if encode is not None else {}
    needed = [name for name, p in taken.items() if name not in ("pixel_values", "kwargs")
              and (p.default is inspect.Parameter.empty or name in _ALWAYS_READ)]
    shaping = [name for name in needed if name in _VALUE_SHAPED]
    if shaping:
        raise ValueError(f"{type(model).__name__} encodes its images with {shaping[0]}: "
                         f"{_VALUE_SHAPED[shaping[0]]} decide how many tokens each image "
                         f"makes, a data-dependent shape fxpar cannot capture; it trains "
                         f"vision-language models whose images make a fixed number of tokens "
                         f"({', '.join(FAMILIES)})")
    if needed:
        what = _OTHER_INPUTS.get(needed[0], "an input")
        raise ValueError(f"{type(model).__name__} needs {needed[0]} ({what}) beside "
                         f"pixel_values to encode its images, which fxpar's batch (tokens, "
                         f"pixel_values, targets) does not provide; it trains vision-language "
                         f"models whose images need only their pixels ({', '.join(FAMILIES)})")
    _check_merged(model, encode)


def _check_merged(model: torch.nn.Module, encode) -> None:
    """Refuses a family that does not merge its image features (from get_image_features, which
    `encode` is or None) at image tokens through get_placeholder_mask - the step
    fixed_image_merge rewrites - naming how it feeds its images instead."""
    merges = any(hasattr(type(m), "get_placeholder_mask") for m in model.modules())
    if encode is not None and merges:
        return
    if hasattr(model.base_model, "get_video_features") and encode is None:
        how = "it encodes videos through get_video_features, not images"
    elif getattr(getattr(model.config, "text_config", None), "cross_attention_layers", None):
        how = "its decoder cross-attends to them in its cross_attention_layers"
    elif encode is not None:
        placed = [p for p in _forward_inputs(model) if "image" in p and "mask" in p]
        how = (f"it places them by the input mask {placed[0]}, which fxpar's batch does not "
               f"provide" if placed else "it places them without get_placeholder_mask")
    else:
        how = "transformers gives it no get_image_features to encode them"
    raise ValueError(f"{type(model).__name__} does not merge image features into the token "
                     f"embeddings at image tokens: {how}; fxpar trains only families that do "
                     f"({', '.join(FAMILIES)})")


def _forward_inputs(model: torch.nn.Module) -> list[str]:
    return list(inspect.signature(type(model).forward).parameters)


_VALUE_SHAPED = {"image_sizes": "the images' sizes (their tiles)",
                 "image_grid_thw": "each image's grid of patches",
                 "pixel_attention_mask": "which images are padding"}
_ALWAYS_READ = ("image_grid_thw", "pixel_attention_mask")  # read when given, made when not
# Inputs beside the pixels that set no count but that fxpar's batch does not make
_OTHER_INPUTS = {"qformer_input_ids": "the Q-Former's instruction tokens",
                 "high_res_pixel_values": "each image again at the high-resolution encoder's "
                                          "size"}
# the families tests train exactly against one process (tests/dist/test_hf_vlm.py)
FAMILIES = ("llava", "paligemma", "gemma3", "internvl", "aya_vision", "vipllava", "blip-2",
            "idefics3", "smolvlm")


def _counting(model, counted: list[int]):
    """get_placeholder_mask records the image features' tokens per image, checks nothing."""
    def record(self, input_ids, inputs_embeds=None, image_features=None, **_):
        count = _image_tokens(self.config, inputs_embeds, image_features, input_ids.shape[0])
        if count is not None:
            counted.append(count)
        return torch.zeros_like(input_ids, dtype=torch.bool).unsqueeze(-1).expand_as(
            inputs_embeds)
    return _masks_by(model, record)


def small_config(arch: str, small_text, **overrides):
    """`arch`'s config with a small decoder (planner.models.hf.small_config's sizes for its text
    model_type) and a small vision tower (VISION_SMALL); `overrides` go to the text config,
    `vision_*` ones to the vision config (vision_num_hidden_layers=4), those of _SMALL_FIELDS
    to the model's config. `small_text(model_type, **fields)` makes the small text config
    (planner.models.hf.small_config)."""
    tf = _transformers()
    if not is_vision_language_arch(arch):
        raise ValueError(f"unknown vision-language architecture {arch!r}: transformers' are "
                         f"{', '.join(architectures())}")
    defaults = tf.AutoConfig.for_model(arch)
    if getattr(defaults.vision_config, "image_size", None) is None:
        raise ValueError(f"{arch}'s vision config ({type(defaults.vision_config).__name__}) "
                         f"states no image_size: its images may be of any size, which fxpar "
                         f"cannot capture as a shape; it trains vision-language models of "
                         f"fixed-size images ({', '.join(FAMILIES)})")
    text = {k: v for k, v in overrides.items() if not k.startswith("vision_")}
    vision = {k.removeprefix("vision_"): v for k, v in overrides.items()
              if k.startswith("vision_")}
    text_config = small_text(defaults.text_config.model_type, **text)
    vision_config = _built(arch, type(defaults.vision_config),
                           **_vision_sizes(defaults.vision_config, text_config, vision))
    fields = dict(text_config=text_config.to_dict(), vision_config=vision_config.to_dict(),
                  image_token_id=text_config.vocab_size - 1)
    fields.update({k: v(vision_config, text_config) for k, v in _SMALL_FIELDS.items()
                   if hasattr(defaults, k)})
    fields.update({k: v for k, v in overrides.items() if k in _SMALL_FIELDS})
    fields.update({k: {**getattr(defaults, k).to_dict(), **v} for k, v in _SMALL_PARTS.items()
                   if getattr(defaults, k, None) is not None})
    # any further part at the decoder's small sizes (Janus' VQ-VAE for image generation)
    fields.update(hf_small.parts(defaults, hf_small.SMALL,
                                 skip=("text_config", "vision_config", *_SMALL_PARTS)))
    return _built(arch, tf.AutoConfig.for_model, arch, **fields)


def _vision_sizes(defaults, text_config, given: dict) -> dict:
    """The small vision tower's fields: VISION_SMALL and `given`, in the (height, width) form
    where the family's config has it, and the fields that must equal the text model's width
    (the projector's output) at the small text model's."""
    # widths and tables the tower sizes apart (Llama 4's pixel-shuffle adapter, Ovis 2's visual
    # vocabulary) at its small width; the text model's width below wins where a field is both
    own = {**hf_small.capped(type(defaults), {**hf_small.SMALL, **VISION_SMALL}), **VISION_SMALL}
    sizes = {**{k: v for k, v in own.items() if k not in _TEXT_WIDTH}, **given}
    if isinstance(defaults.image_size, (tuple, list)):  # (height, width) forms
        sizes = {k: (v, v) if k in ("image_size", "patch_size") and isinstance(v, int) else v
                 for k, v in sizes.items()}
    for name in _TEXT_WIDTH:
        if hasattr(defaults, name):
            sizes.setdefault(name, text_config.hidden_size)
    return sizes


def _built(arch: str, make, *args, **fields):
    """`make(*args, **fields)`, a transformers config; its rejection (a validator of the family
    tying two fields fxpar does not shrink together) one line naming the family and the field."""
    try:
        return make(*args, **fields)
    except Exception as err:  # noqa: BLE001 - transformers' validators raise assorted types
        cause = err.__cause__ or err
        first = " ".join(str(cause).split())[:240].rstrip(".") or type(cause).__name__
        raise ValueError(f"{arch}: transformers rejects the family's config at fxpar's small "
                         f"sizes ({first}); plan a config.json of {arch} with --hf-config"
                         ) from None


# Vision config fields that must equal the text model's width: CLIP-like projections, the
# projector's output of Qwen-style towers (Granite Docling validates it against the decoder)
_TEXT_WIDTH = ("projection_dim", "out_hidden_size", "text_hidden_size")
# Further sub-configs at small sizes, dropout off as in the other parts: BLIP-2's Q-Former (its
# width follows the vision tower's; transformers sets encoder_hidden_size to it)
_SMALL_PARTS = {"qformer_config": dict(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)}


def _patches(vision) -> int:
    size, patch = vision.image_size, vision.patch_size
    size = size if isinstance(size, int) else size[0]
    patch = patch if isinstance(patch, int) else patch[0]
    return (size // patch) ** 2


# Fields of the families' configs that follow the small vision tower: its patches per image (Llava
# counts them; BLIP-2's Q-Former makes as many query tokens), tokens per image after pooling
# (Gemma 3: 4 of 16 patches), the projector's width, the layers whose outputs are merged
# (VipLlava: the last two of two)
_SMALL_FIELDS = {
    "image_seq_length": lambda vision, text: _patches(vision),
    "num_query_tokens": lambda vision, text: _patches(vision),
    "mm_tokens_per_image": lambda vision, text: _patches(vision) // 4,
    "projection_dim": lambda vision, text: text.hidden_size,
    "vision_feature_layers": lambda vision, text: (-2, -1),
}


def from_config(config) -> HFVisionLM:
    """The model of `config` with planner.models.hf_attention's SDPA (the decoder's plain causal
    attention stays is_causal; the vision tower's has no mask)."""
    tf = _transformers()
    from planner.models import hf_attention
    model_cls = tf.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    attention = (hf_attention.register() if getattr(model_cls, "_supports_attention_backend",
                                                    False)
                 else "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager")
    try:
        model = tf.AutoModelForImageTextToText.from_config(config, attn_implementation=attention)
    except ValueError as err:  # a part without SDPA (GOT-OCR2's vision encoder): eager
        if "attention implementation" not in str(err):
            raise
        model = tf.AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    _draw_zero_embeddings(model)
    return HFVisionLM(model)


def _draw_zero_embeddings(model: torch.nn.Module) -> None:
    """Draws the learned embeddings transformers starts at zero (BLIP-2's query tokens) like
    the model's other weights, normal with its initializer_range: a pretrained checkpoint never
    holds them at zero, and a randomly initialised model that does cannot train. A layer norm
    of an all-zero row has zero variance and divides its gradient by sqrt(eps) (1e-6 at the
    Q-Former's eps of 1e-12): the query tokens' first gradient is ~1e17, and from the second
    step on the gradients depend on fp32 summation order alone (one batch and the same batch
    as two micro-batches differ by 100%), NaN from the third, in one process. Linear,
    convolution and norm weights are never all zero, and their zero biases are 1-D."""
    std = _initializer_range(model.config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and not param.is_meta and not param.count_nonzero():
                param.normal_(0.0, std)


def _initializer_range(config) -> float:
    """The model's initializer_range, its text config's where the model's config has none."""
    for part in (config, getattr(config, "text_config", None)):
        std = getattr(part, "initializer_range", None)
        if isinstance(std, float):
            return std
    return 0.02
