"""Ernie 4.5 VL (transformers ``Ernie4_5_VLMoeForConditionalGeneration``): images and videos on
their own placeholder tokens, M-RoPE positions from the ids, ``mm_token_type_ids`` and the grids.

- image: ``<|IMAGE_START|>`` ``<|IMAGE_PLACEHOLDER|>``x(h*w/4) ``<|IMAGE_END|>``; ``pixel_values``
  ``[sum(h*w), 3*14*14]`` patch rows (temporal patch 1, Qwen-VL's row order) with
  ``image_grid_thw`` (1, h, w).
- video: ``<|VIDEO_START|>`` ``<|VIDEO_PLACEHOLDER|>``x(t*h*w/8) ``<|VIDEO_END|>``, one run per
  video (the resampler merges frames in pairs); ``pixel_values_videos`` with ``video_grid_thw``.

``mm_token_type_ids`` (1 image, 2 video on the placeholders) feeds the rope;
``moe_mm_token_type_ids`` (the markers too) routes tokens to the vision experts: a dropped
sample's placeholders are text in both. The forward computes no M-RoPE from embeddings: the
guard passes ``position_ids`` from the model's own ``get_rope_index`` on the rewritten ids and
kept grids. Image repair: the image processor's ``smart_resize`` (``PatchMergeGeometry``),
re-encoded through ``get_image_features`` (tower and resampler); videos are never repaired.
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
    """``encode`` on the pixels after the Bridge model's own ``_normalize_pixel_values`` (its
    forward rescales and CLIP-normalizes the processor's raw patches before the tower)."""

    def run(model: Any, kw) -> Encoded:
        return encode(model, {**kw, key: model._normalize_pixel_values(kw[key])})

    return run


#: Megatron-Bridge 0.6.2 ``Ernie45VLModel.forward(input_ids, attention_mask, position_ids,
#: inputs_embeds, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw,
#: mm_token_type_ids, moe_mm_token_type_ids, ...)``: it merges only while pixels are given and
#: always computes its M-RoPE itself from ``input_ids`` and the grids (``position_ids``
#: ignored). Repair resizes the normalized pixels (the normalization is per channel).
_IMG, _VID = SPEC.modalities
BRIDGE = SPEC.bridge(
    "Ernie45VLModel",
    modalities=(
        replace(_IMG, encode=_normalized(_encode_image, "pixel_values")),
        replace(_VID, encode=_normalized(_encode_video, "pixel_values_videos")),
    ),
    positions=None,
)
