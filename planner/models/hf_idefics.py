"""Idefics 3 and SmolVLM as fxpar trains them: every image whole and real.

Both families pad a batch's images to the largest and mark the padding twice: whole images of
zeros, which `get_image_features` drops (`pixel_values[real_images_inds]`, a number of rows read
from the pixels' values), and padded pixels (pixel_attention_mask, whose patches set each
image's positions). fxpar's batch holds one whole image per sample at the vision config's
image_size, where neither occurs: `fixed_images` encodes every image through the vision
transformer's own path for an unpadded image (no patch mask: all its patches, positions
0..n-1), then the connector, whose image_seq_len tokens per image are a shape. Idefics 3 fills
its image tokens in `inputs_merger` with a batch-wide count check read from the tokens' values;
under `fixed_images` it merges through `get_placeholder_mask` as SmolVLM and the Llava families
do, which planner.models.hf_vlm rewrites to a per-sample check the graph keeps.
"""
from __future__ import annotations

import contextlib

import torch

MODEL_TYPES = ("idefics3", "smolvlm")


def _image_features(self, pixel_values, padding=None, **kwargs):
    """Every image encoded whole: [batch (x images), C, H, W] -> the connector's tokens of all
    the images, one after another. `padding`: the family's pixel_attention_mask, none here."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    if padding is not None:
        raise ValueError(f"{type(self).__name__}: fxpar trains on whole images at the vision "
                         f"config's image_size; give no pixel_attention_mask")
    if pixel_values.dim() == 5:   # [batch, images per sample, C, H, W]
        pixel_values = pixel_values.flatten(0, 1)
    hidden = self.vision_model(pixel_values=pixel_values.to(dtype=self.dtype),
                               return_dict=True).last_hidden_state
    features = self.connector(hidden)
    return BaseModelOutputWithPooling(last_hidden_state=hidden,
                                      pooler_output=features.flatten(0, 1))


def _merge(self, input_ids, inputs_embeds, image_hidden_states):
    """Idefics 3's inputs_merger, through get_placeholder_mask."""
    mask = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds,
                                     image_features=image_hidden_states)
    return inputs_embeds.masked_scatter(mask, image_hidden_states.to(inputs_embeds.dtype))


@contextlib.contextmanager
def fixed_images(model: torch.nn.Module, placeholder_mask):
    """While active, the Idefics 3 / SmolVLM modules of `model` encode whole images
    (`_image_features`) and merge them through get_placeholder_mask (`placeholder_mask` where
    the class has none); nothing changes for other families."""
    owners = {type(m) for m in model.modules()
              if type(m).__name__ in ("Idefics3Model", "SmolVLMModel")}
    saved = [(cls, name, cls.__dict__[name]) for cls in owners
             for name in ("get_image_features", "inputs_merger") if name in cls.__dict__]
    added = [cls for cls in owners if not hasattr(cls, "get_placeholder_mask")]
    for cls in owners:
        cls.get_image_features = _image_features
        if "inputs_merger" in cls.__dict__:
            cls.inputs_merger = _merge
    for cls in added:
        cls.get_placeholder_mask = placeholder_mask
    try:
        yield
    finally:
        for cls in added:
            del cls.get_placeholder_mask
        for cls, name, value in saved:
            setattr(cls, name, value)
