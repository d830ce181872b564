"""GLM-4V / GLM-4.1V / GLM-4.5V (``Glm4v*``, ``Glm4vMoe*``; Bridge ``GLM45VModel``): grammar,
counts and repair: docs/FAMILIES.md. A video is t runs of h*w/4 on the image token (per
temporal patch of 2 frames), its model-level item; ``mm_token_type_ids`` (1 image, 2 video)
tells a frame run from an image run; the video markers stay text.
"""

from __future__ import annotations

from typing import Any

from ..geometry import PatchMergeGeometry
from .common import PAD, hf_classes
from .mrope import grid_counts, image_encoder, patch_dummy, rope_positions
from .spec import Encoded, FamilySpec, ModalitySpec, Token

PATCH, TEMPORAL, MERGE = 14, 2, 2
_encode_image, _reencode_image = image_encoder(PATCH, TEMPORAL, MERGE)


def _encode_video(model: Any, kw) -> Encoded:
    pv, grid = kw["pixel_values_videos"], kw["video_grid_thw"]
    out = model.get_video_features(pv, grid, return_dict=True).pooler_output
    # one item per video, its t frame runs counted on the device: the engine cuts it into
    # them once the merge's one transfer brought t (no read of the grids here)
    feats = tuple(out)
    return Encoded(feats, num_frames=(TEMPORAL,) * len(feats), runs=grid[:, 0])


def geometry(model: Any = None) -> PatchMergeGeometry:
    """``Glm4vImageProcessor``'s sizing (factor 28; ``size`` = 112*112 .. 28*28*15000 pixels;
    an image a clip of 2 frames)."""
    return PatchMergeGeometry(
        patch=PATCH,
        merge=MERGE,
        temporal_patch=TEMPORAL,
        min_pixels=112 * 112,
        max_pixels=28 * 28 * 15000,
        temporal_budget=True,
        min_frames=TEMPORAL,
    )


_IMAGE = Token(("image_token_id",), "<|image|>")

SPEC = FamilySpec(
    name="glm4v",
    classes=hf_classes("Glm4v", "Glm4vMoe"),
    modalities=(
        ModalitySpec(
            "image",
            _IMAGE,
            ("pixel_values", "image_grid_thw"),
            _encode_image,
            start=Token(("image_start_token_id",), "<|begin_of_image|>"),
            end=Token(("image_end_token_id",), "<|end_of_image|>"),
            reencode=_reencode_image,
            keep=("image_grid_thw",),
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=grid_counts("image_grid_thw", False),
            type_id=1,
        ),
        ModalitySpec(
            "video",
            _IMAGE,
            ("pixel_values_videos", "video_grid_thw"),
            _encode_video,
            shares="image",
            keep=("video_grid_thw",),
            rows=("video_grid_thw",),
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=grid_counts("video_grid_thw", True),
            type_id=2,
        ),
    ),
    text=Token(PAD, "<|endoftext|>", 151329),
    geometry=geometry,
    follow_ids=("mm_token_type_ids",),
    token_types="mm_token_type_ids",
    positions=rope_positions,
    ids_with_embeds=False,
    dummy=patch_dummy("visual"),
)

#: Megatron-Bridge 0.6.2 ``GLM45VModel``: it merges only while pixels are given and computes
#: its M-RoPE itself from the ids: the guard passes the ids with the embeddings, no positions
BRIDGE = SPEC.bridge("GLM45VModel", positions=None)
