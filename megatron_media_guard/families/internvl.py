"""InternVL (transformers ``InternVLForConditionalGeneration``; Megatron-Bridge 0.6.2 has no
InternVL class): tiles of ``image_seq_length`` features each, whose count per image never
reaches the model.

- image: ``<img>`` ``<IMG_CONTEXT>``x(``image_seq_length`` * tiles) ``</img>``; video: per frame
  "Frame{i}: " ``<img>`` ``<IMG_CONTEXT>``x``image_seq_length`` ``</img>`` (a frame is one
  tile, on the same token). ``pixel_values`` ``[sum(tiles), 3, S, S]`` holds every image's and
  video's tiles in prompt order; the processor pops ``num_patches``.
- so the model has one modality ("image") and its output one flat block of tile features: the
  engine cuts it (``Encoded.split="items"``) by ``set_items``' ``num_features`` (one item per
  image, ``image_seq_length`` * its tiles, and one per video frame), else by the runs in the ids,
  in token order, with a ``check`` record saying the per-image tile counts were not given and
  only the total was checked (a +k/-k or a swap of tile counts cannot be seen then).

Repair: none (a tile count follows the image's aspect ratio, but the model gets tiles, not the
image to re-tile): a repair falls back ("no geometry for internvl").
"""

from __future__ import annotations

from typing import Any

import torch

from .common import PAD, hf_classes
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table, tower_zeros


def _encode_image(model: Any, kw) -> Encoded:
    out = model.get_image_features(
        kw["pixel_values"],
        vision_feature_layer=kw.get("vision_feature_layer"),
        vision_feature_select_strategy=kw.get("vision_feature_select_strategy"),
        return_dict=True,
    ).pooler_output  # [tiles, image_seq_length, hidden]
    return Encoded((out.reshape(-1, out.shape[-1]),), split="items")


def _counts(config: Any, kw) -> torch.Tensor:
    """The call's tiles as one block of ``image_seq_length`` features each (``split="items"``:
    which tiles make which image is the caller's, ``check_batch(items=...)``)."""
    pv = kw["pixel_values"]
    tiles = torch.full((1,), int(config.image_seq_length), device=pv.device)
    return count_table(tiles, runs=pv.shape[0], hw=tuple(pv.shape[-2:]))


def _dummy(model: Any):  # one tile of zeros through the tower and the projector
    h, w = model.config.vision_config.image_size
    pv = tower_zeros(model, "vision_tower", 1, 3, h, w)
    return model.get_image_features(pv, return_dict=True).pooler_output


SPEC = FamilySpec(
    name="internvl",
    classes=hf_classes("InternVL"),
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<IMG_CONTEXT>"),
            ("pixel_values", "vision_feature_layer", "vision_feature_select_strategy"),
            _encode_image,
            start=Token((), "<img>"),
            end=Token((), "</img>"),
            rows=("pixel_values",),
            counts=_counts,
            split="items",
        ),
    ),
    text=Token(PAD, "<|endoftext|>", 0),
    ids_with_embeds=False,
    dummy=_dummy,
)
