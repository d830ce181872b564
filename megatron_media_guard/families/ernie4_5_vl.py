"""Ernie 4.5 VL (``Ernie4_5_VLMoe*``; Bridge ``Ernie45VLModel``): image patch rows of temporal
patch 1 in Qwen-VL's row order; grammar, counts and repair: docs/FAMILIES.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..geometry import PatchMergeGeometry
from .common import PAD, feature_call, hf_classes
from .mrope import grid_counts, image_encoder, patch_dummy, rope_positions
from .spec import Encoded, FamilySpec, ModalitySpec, Token

PATCH, MERGE = 14, 2
_encode_image, _reencode_image = image_encoder(PATCH, 1, MERGE)


_encode_video = feature_call("get_video_features", "pixel_values_videos", "video_grid_thw")


def geometry(model: Any = None) -> PatchMergeGeometry:
    """``Ernie4_5_VLMoeImageProcessor``'s sizing (factor 28; ``size`` = 56*56 .. 28*28*6177)."""
    return PatchMergeGeometry(
        patch=PATCH, merge=MERGE, temporal_patch=2, min_pixels=56 * 56, max_pixels=28 * 28 * 6177
    )


SPEC = FamilySpec(
    name="ernie4_5_vl",
    # (the deprecated Ernie4_5_VL_MoeForConditionalGeneration subclasses the first)
    classes=hf_classes("Ernie4_5_VLMoe"),
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<|IMAGE_PLACEHOLDER|>"),
            ("pixel_values", "image_grid_thw"),
            _encode_image,
            start=Token(("image_start_token_id",), "<|IMAGE_START|>"),
            end=Token(("image_end_token_id",), "<|IMAGE_END|>"),
            reencode=_reencode_image,
            keep=("image_grid_thw",),
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=grid_counts("image_grid_thw", False),
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|VIDEO_PLACEHOLDER|>"),
            ("pixel_values_videos", "video_grid_thw"),
            _encode_video,
            start=Token(("video_start_token_id",), "<|VIDEO_START|>"),
            end=Token(("video_end_token_id",), "<|VIDEO_END|>"),
            keep=("video_grid_thw",),
            rows=("video_grid_thw",),
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=grid_counts("video_grid_thw", False, 8),
        ),
    ),
    text=Token(PAD, "<unk>", 0),
    geometry=geometry,
    follow_ids=("mm_token_type_ids", "moe_mm_token_type_ids"),
    positions=rope_positions,
    ids_with_embeds=False,
    dummy=patch_dummy("vision_tower"),
)


def _normalized(encode, key: str):
    """``encode`` on the pixels after the Bridge model's own ``_normalize_pixel_values`` (as its
    forward does before the tower)."""

    def run(model: Any, kw) -> Encoded:
        return encode(model, {**kw, key: model._normalize_pixel_values(kw[key])})

    return run


#: Megatron-Bridge 0.6.2 ``Ernie45VLModel``: it merges only while pixels are given and computes
#: its M-RoPE itself from the ids. Repair resizes the normalized pixels (per channel).
_IMG, _VID = SPEC.modalities
BRIDGE = SPEC.bridge(
    "Ernie45VLModel",
    modalities=(
        replace(_IMG, encode=_normalized(_encode_image, "pixel_values")),
        replace(_VID, encode=_normalized(_encode_video, "pixel_values_videos")),
    ),
    positions=None,
)
