"""Gemma 3 (``Gemma3ForConditionalGeneration``; Bridge ``Gemma3VLModel``): ``mm_tokens_per_image``
per ``pixel_values`` row ``[3, S, S]`` (pan-and-scan crops are extra rows, each one item);
grammar and repair: docs/FAMILIES.md."""

from __future__ import annotations

from typing import Any

import torch

from ..geometry import FixedGeometry
from .common import PAD, PIXELS, hf_classes, tower_dummy
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table


def _encode_image(model: Any, kw) -> Encoded:
    pv = kw["pixel_values"]
    feats = tuple(model.get_image_features(pv, return_dict=True).pooler_output)  # [rows, mm, h]
    if not kw.get(PIXELS):
        return Encoded(feats)
    hw = (int(pv.shape[-2]), int(pv.shape[-1]))
    return Encoded(feats, frame_hw=(hw,) * pv.shape[0], pixels=tuple(pv))


def _reencode_image(model: Any, img: torch.Tensor) -> torch.Tensor:
    return model.get_image_features(img[None], return_dict=True).pooler_output[0]


def _counts(config: Any, kw) -> torch.Tensor:
    """``mm_tokens_per_image`` per pixel row (crops included), at the rows' size."""
    pv = kw["pixel_values"]
    n = torch.full((pv.shape[0],), int(config.mm_tokens_per_image), device=pv.device)
    return count_table(n, hw=tuple(pv.shape[-2:]))


def _geometry(model: Any) -> FixedGeometry:
    cfg = model.config
    size = int(cfg.vision_config.image_size)
    return FixedGeometry(tokens_per_image=int(cfg.mm_tokens_per_image), size=(size, size))


SPEC = FamilySpec(
    name="gemma3",
    classes=hf_classes("Gemma3"),
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id", "image_token_index"), "<image_soft_token>"),
            ("pixel_values",),
            _encode_image,
            start=Token(("boi_token_id", "vision_start_token_id"), "<start_of_image>"),
            end=Token(("eoi_token_id", "vision_end_token_id"), "<end_of_image>"),
            reencode=_reencode_image,
            rows=("pixel_values",),
            counts=_counts,
        ),
    ),
    text=Token(PAD, "<pad>", 0),
    geometry=_geometry,
    follow_ids=("token_type_ids",),
    ids_with_embeds=False,
    # one S x S image of zeros through the tower and the projector
    dummy=tower_dummy("get_image_features", lambda v: (1, 3, v.image_size, v.image_size)),
)

#: Megatron-Bridge 0.6.2 ``Gemma3VLModel``: its provider names the markers
#: ``vision_start_token_id`` / ``vision_end_token_id``
BRIDGE = SPEC.bridge("Gemma3VLModel")
