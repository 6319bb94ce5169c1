"""Qwen2-VL and Qwen2.5-VL: a vision transformer over a grid of patches, merged 2x2 into the
decoder's width, and a decoder with 3-D rotary positions (M-RoPE), trained on images of one
fixed size.

transformers lets every image have its own grid of patches (`image_grid_thw`), and reads the
grid's values wherever a shape follows from it: the vision tower's rotary positions (Python loops
over the grids), its attention within each image (`torch.split` of the packed patches at lengths
read from the grids), the split of the merged features per image, and the decoder's M-RoPE
positions (`get_rope_index`, which walks every sample's token ids). None of that can be captured
on fake tensors. With one grid for every image it all becomes static:

- the decoder's positions depend on the data alone (where the image tokens are): the data side
  computes them with transformers' own `get_rope_index` (`HFQwenVisionLM.positions`) and passes
  them in, [batch, 3, seq], the batch first as fxpar splits every input;
- the vision tower runs on [images, patches, width] (`fixed_grid`): each image's attention is
  attention over one row of that batch, its rotary positions are those of the grid (aranges of
  known sizes), and the merger's 2x2 groups of patches are consecutive rows as before;
- Qwen2.5-VL's window attention (all blocks but fullatt_block_indexes) reorders each image's
  patches window by window, as transformers does: with windows that tile the image, all of one
  size, a window's attention is attention over one row of [images x windows, window patches],
  and the order is a fixed permutation, undone on the merged features;
- pixel values come as [batch, patches, channels x temporal patch x patch x patch]: one image per
  sample, its patches in the order Qwen2-VL's image processor writes them (2x2 merge blocks one
  after another), so a micro-batch of whole samples carries its own images.

The image size is the vision config's `image_size` (pixels, an int or [height, width]; not a
field of transformers' config, add it to config.json's "vision_config"), 448x448 without one:
a grid of 32x32 patches of 14 pixels, 256 image tokens after the 2x2 merge (Qwen2.5-VL: 16
windows of 8x8 patches).
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from planner.models import hf_vlm
from planner.models.hf_wrapper import HFWrapper

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
DEFAULT_IMAGE_SIZE = 448   # pixels, when the vision config names no image_size
# The vision towers at sizes that train on CPU ranks, patches of 4x4 pixels merged 2x2, by
# family: (the vision config's field of its output width, the decoder's; its small sizes).
# Qwen2-VL: 16x16 images, a 4x4 grid, 4 image tokens. Qwen2.5-VL: 32x32 images, an 8x8 grid in
# 4 windows of 16 patches (block 0 attends within windows, block 1 over the whole image).
PATCHES_SMALL = dict(patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
VISION_SMALL = {
    "qwen2_vl": ("hidden_size", dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2,
                                     image_size=16)),
    "qwen2_5_vl": ("out_hidden_size", dict(depth=2, hidden_size=32, intermediate_size=64,
                                           num_heads=4, image_size=32, window_size=16,
                                           fullatt_block_indexes=[1])),
}


def handles(config) -> bool:
    """Whether `config` is of a family this module trains (rather than hf_vlm's wrapper)."""
    return getattr(config, "model_type", None) in MODEL_TYPES


def image_grid(vision) -> tuple[int, int, int]:
    """(t, h, w): the grid of patches of every image, from the vision config's image size. An
    image is one temporal patch (the processor repeats it temporal_patch_size times)."""
    height, width = _image_size(getattr(vision, "image_size", None) or DEFAULT_IMAGE_SIZE)
    step = vision.patch_size * vision.spatial_merge_size
    if height % step or width % step:
        raise ValueError(f"image size {height}x{width} is not a multiple of patch_size x "
                         f"spatial_merge_size = {step} pixels: set the vision config's "
                         f"image_size to one (Qwen2-VL's processor resizes images to such sizes)")
    grid = (1, height // vision.patch_size, width // vision.patch_size)
    window_side(vision, grid)  # windows that tile the image, if it has any
    return grid


def _image_size(size) -> tuple[int, int]:
    """(height, width) in pixels from an int or a [height, width] pair."""
    pair = (size, size) if isinstance(size, int) else tuple(size) if isinstance(
        size, (list, tuple)) else ()
    if len(pair) != 2 or not all(isinstance(x, int) and x > 0 for x in pair):
        raise ValueError(f"the vision config's image_size {size!r} is not a size in pixels: "
                         f"give an int (square images) or [height, width]")
    return pair


def window_side(vision, grid: tuple[int, int, int]) -> int | None:
    """Merged tokens along each side of an attention window (Qwen2.5-VL's window_size, in
    pixels), None without window attention. Windows that tile the image are all of one size;
    others would not be."""
    size = getattr(vision, "window_size", None)
    if not size:
        return None
    merge = vision.spatial_merge_size
    side = size // merge // vision.patch_size                 # merged tokens per window side
    _, h, w = grid
    if side < 1 or (h // merge) % side or (w // merge) % side:
        step = max(side, 1) * merge * vision.patch_size
        raise ValueError(f"image size {h * vision.patch_size}x{w * vision.patch_size} is not "
                         f"tiled by the attention windows of {step} pixels (window_size "
                         f"{size}): set the vision config's image_size to a multiple of {step}")
    return side


def small_config(arch: str, small_text, **overrides):
    """`arch`'s config with a small decoder and a small vision tower (VISION_SMALL, whose output
    width is the decoder's); `vision_*` overrides go to the vision config, the others to the text
    config. M-RoPE's sections follow the small head size, in Qwen2-VL's proportions."""
    tf = hf_vlm._transformers()
    defaults = tf.AutoConfig.for_model(arch)
    text = {k: v for k, v in overrides.items() if not k.startswith("vision_")}
    vision = {k.removeprefix("vision_"): v for k, v in overrides.items()
              if k.startswith("vision_")}
    width, sizes = VISION_SMALL[arch]
    probe = small_text(defaults.text_config.model_type, **text)
    half = probe.hidden_size // probe.num_attention_heads // 2
    text.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": _mrope_section(half)})
    text_config = small_text(defaults.text_config.model_type, **text)
    vision_config = type(defaults.vision_config)(
        **{**PATCHES_SMALL, **sizes, width: text_config.hidden_size, **vision})
    return tf.AutoConfig.for_model(arch, text_config=text_config.to_dict(),
                                   vision_config=vision_config.to_dict(),
                                   image_token_id=text_config.vocab_size - 1)


def _mrope_section(half: int) -> list[int]:
    """The rotary frequencies given to (time, height, width): Qwen2-VL's 16:24:24 of 64."""
    spatial = half * 3 // 8
    return [half - 2 * spatial, spatial, spatial]


class HFQwenVisionLM(HFWrapper):
    """(tokens, pixel_values, positions, targets) -> the mean cross-entropy of every position
    against its target, the next token (image positions included: give them -100 to leave them
    out). pixel_values [batch, patches, features]: each sample's image; positions [batch, 3, seq]:
    its M-RoPE positions (`positions(tokens)`)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.grid = image_grid(model.config.vision_config)

    def forward(self, tokens, pixel_values, positions, targets):
        self._check_shapes(tokens, pixel_values, positions)
        with fixed_grid(self.model, self.grid):
            logits = self.model(input_ids=tokens, pixel_values=pixel_values.flatten(0, 1),
                                position_ids=positions.permute(1, 0, 2),
                                use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               ignore_index=-100)

    def _check_shapes(self, tokens, pixel_values, positions) -> None:
        """Shapes are static (read while capturing too): a batch of another image size or
        positions of another form is refused here, naming what was expected."""
        expected = (tokens.shape[0], self.patches(), self.features())
        if tuple(pixel_values.shape) != expected:
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; expected "
                             f"{list(expected)} (one image of grid {self.grid} per sample, "
                             f"[batch, patches, channels*temporal*patch*patch]): resize the "
                             f"images, or set the vision config's image_size to theirs")
        if tuple(positions.shape) != (tokens.shape[0], 3, tokens.shape[1]):
            raise ValueError(f"positions has shape {list(positions.shape)}; expected "
                             f"[{tokens.shape[0]}, 3, {tokens.shape[1]}] (M-RoPE's time, height "
                             f"and width positions of every token: HFQwenVisionLM.positions)")

    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def features(self) -> int:
        vision = self.model.config.vision_config
        return vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2

    def image_tokens(self) -> int:
        """Tokens per image: its patches, merged spatial_merge_size x spatial_merge_size."""
        return self.patches() // self.model.config.vision_config.spatial_merge_size ** 2

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, 3, seq]: the M-RoPE positions of `tokens` with one image of the fixed grid at
        each run of image tokens, by transformers' own get_rope_index."""
        image = tokens == self.model.config.image_token_id
        grids = torch.tensor([self.grid], device=tokens.device).expand(tokens.shape[0], 3)
        found, _ = self.model.model.get_rope_index(tokens, image.int(), image_grid_thw=grids)
        return found.permute(1, 0, 2).contiguous()

    def example_inputs(self, batch: int, seq: int, device="cpu",
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """Random tokens with one image's tokens after the first token of each sample, random
        pixels, their positions, targets with the image positions left out (-100)."""
        config, count = self.model.config, self.image_tokens()
        if seq < count + 2:
            raise ValueError(f"a sequence of {seq} tokens cannot hold an image of {count} "
                             f"tokens and text: give --seq of at least {count + 2}")
        shape, pixels = (batch, seq), (batch, self.patches(), self.features())
        if str(device) == "meta":
            tokens = torch.zeros(shape, dtype=torch.long, device="meta")
            return (tokens, torch.zeros(pixels, device="meta"),
                    torch.zeros(batch, 3, seq, dtype=torch.long, device="meta"), tokens)
        image_id, vocab = config.image_token_id, config.text_config.vocab_size
        tokens = torch.randint(0, vocab - 1, shape, generator=generator)
        tokens = torch.where(tokens >= image_id, tokens + 1, tokens) % vocab
        tokens[:, 1:1 + count] = image_id
        targets = torch.randint(0, vocab, shape, generator=generator)
        targets[:, :1 + count] = -100
        return (tokens, torch.randn(pixels, generator=generator), self.positions(tokens),
                targets)

    def fxpar_plan_notes(self, example_inputs) -> list[str]:
        """The image size the plan prices: the config's, or the default when it names none."""
        _, h, w = self.grid
        patch = self.model.config.vision_config.patch_size
        return [f"images of {h * patch}x{w * patch} pixels: {h}x{w} patches, "
                f"{self.image_tokens()} image tokens per sample (the vision config's image_size, "
                f"{DEFAULT_IMAGE_SIZE} without one)"]


@contextlib.contextmanager
def fixed_grid(model: torch.nn.Module, grid: tuple[int, int, int]):
    """While active, `model` (a Qwen2-VL or Qwen2.5-VL) encodes images of `grid` in a static
    form: the vision tower on [images, patches, width], each image's (each window's) attention
    over its own row, its rotary positions from aranges; and the image tokens are checked per
    sample in the graph (hf_vlm's merge) instead of over the batch in Python."""
    base = type(model.model)
    attention = type(model.model.visual.blocks[0].attn)
    saved = {(base, "get_image_features"): base.get_image_features,
             (base, "get_placeholder_mask"): base.get_placeholder_mask,
             (attention, "forward"): attention.forward}

    def features(self, pixel_values, image_grid_thw=None, **_):
        return _image_features(self.visual, pixel_values, grid)

    base.get_image_features = features
    base.get_placeholder_mask = _placeholder_masks
    attention.forward = _image_attention
    try:
        yield
    finally:
        for (cls, name), method in saved.items():
            setattr(cls, name, method)


def _image_features(visual, pixel_values, grid):
    """transformers' vision forward for images of one grid: the merged features of every image,
    one after another, as get_image_features returns them (a tuple of parts to concatenate)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    _, h, w = grid
    merge, side = visual.spatial_merge_size, window_side(visual.config, grid)
    window = None if side is None else (side * merge) ** 2       # patches per window
    hidden = visual.patch_embed(pixel_values.type(visual.dtype))
    hidden = hidden.view(-1, h * w, hidden.shape[-1])            # [images, patches, width]
    rotary = visual.rotary_pos_emb(hidden, _patch_positions(h, w, merge, hidden.device))
    order = None if side is None else _window_order(h // merge, w // merge, side, hidden.device)
    if order is not None:  # window by window, as transformers' window_index orders them
        hidden = _in_order(hidden, order, merge ** 2, dim=1)
        rotary = tuple(_in_order(x, order, merge ** 2, dim=0) for x in rotary)
    full = set(getattr(visual.config, "fullatt_block_indexes", ()) or ())
    for i, block in enumerate(visual.blocks):
        hidden = block(hidden, cu_seqlens=None, position_embeddings=rotary,
                       fxpar_window=None if i in full else window)
    merged = visual.merger(hidden)
    if order is not None:  # each image's merged tokens back in the order of its patches
        merged = merged.view(hidden.shape[0], -1, merged.shape[-1])[:, torch.argsort(order)]
        merged = merged.flatten(0, 1)
    return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=(merged,))


def _window_order(h: int, w: int, side: int, device) -> torch.Tensor:
    """The merged tokens of an h x w grid (2x2 merge blocks) in windows of side x side, window
    after window (transformers' get_vision_window_index for one grid whose windows tile it)."""
    tokens = torch.arange(h * w, device=device).view(h // side, side, w // side, side)
    return tokens.permute(0, 2, 1, 3).flatten()


def _in_order(x: torch.Tensor, order: torch.Tensor, unit: int, dim: int) -> torch.Tensor:
    """x's `dim` (patches, in groups of `unit` merged together) with its groups in `order`."""
    groups = x.unflatten(dim, (-1, unit))
    return groups.index_select(dim, order).flatten(dim, dim + 1)


def _patch_positions(h: int, w: int, merge: int, device) -> torch.Tensor:
    """[h*w, 2]: each patch's (row, column) in the order of the image's patches, 2x2 merge
    blocks one after another (transformers' get_vision_position_ids for one grid)."""
    rows, columns = torch.meshgrid(torch.arange(h, device=device),
                                   torch.arange(w, device=device), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    columns = columns.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack([rows, columns], dim=-1)


def _image_attention(self, hidden_states, cu_seqlens=None, position_embeddings=None,
                     fxpar_window=None, **_):
    """The vision attention on [images, patches, width], no mask: each image (each window of
    `fxpar_window` patches) attends within itself, as transformers' attention over the chunks of
    cu_seqlens. The fused projection is cut into q, k, v by chunk (the same columns as its
    reshape to (3, heads, head_dim))."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    family = sys.modules[type(self).__module__]
    images, patches, _ = hidden_states.shape
    q, k, v = (x.view(images, patches, -1, self.head_dim)
               for x in self.qkv(hidden_states).chunk(3, dim=-1))
    cos, sin = position_embeddings
    q, k = family.apply_rotary_pos_emb_vision(q, k, cos, sin)
    if fxpar_window is not None:  # [images x windows, window patches, heads, head_dim]
        q, k, v = (x.view(-1, fxpar_window, *x.shape[2:]) for x in (q, k, v))
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                   family.eager_attention_forward)
    out, _ = attend(self, q, k, v, attention_mask=None, scaling=self.scaling, dropout=0.0,
                    is_causal=False)
    return self.proj(out.reshape(images, patches, -1).contiguous())


def _placeholder_masks(self, input_ids, inputs_embeds=None, image_features=None,
                       video_features=None):
    """(image mask, no video mask): the image tokens checked per sample, in the graph."""
    if video_features is not None:
        raise ValueError("fxpar trains Qwen2-VL on images, not videos: give each frame as an "
                         "image (pixel_values), not pixel_values_videos")
    return hf_vlm._placeholder_mask(self, input_ids, inputs_embeds, image_features), None


def from_config(config) -> HFQwenVisionLM:
    """The model of `config` with planner.models.hf_attention's SDPA (the decoder's causal
    attention stays is_causal; the vision tower's has no mask)."""
    tf = hf_vlm._transformers()
    from planner.models import hf_attention
    return HFQwenVisionLM(tf.AutoModelForImageTextToText.from_config(
        config, attn_implementation=hf_attention.register()))
