"""InternVL (``InternVLForConditionalGeneration``): ``pixel_values`` ``[sum(tiles), 3, S, S]`` in
prompt order, tiles per image never reaching the model: encoded as one flat block
(``split="items"``). Grammar: docs/FAMILIES.md; no repair (the model gets tiles, not the image).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import PAD, hf_classes, tower_dummy
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table


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
    # one tile of zeros through the tower and the projector
    dummy=tower_dummy("get_image_features", lambda v: (1, 3, *v.image_size)),
)
