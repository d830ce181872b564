"""GLM-4V / GLM-4.1V / GLM-4.5V (transformers ``Glm4vForConditionalGeneration``,
``Glm4vMoeForConditionalGeneration``): images and video frames on ONE placeholder token, M-RoPE
positions from the ids, ``mm_token_type_ids`` and the grids.

- image: ``<|begin_of_image|>`` ``<|image|>``x(h*w/4) ``<|end_of_image|>``; ``pixel_values``
  ``[sum(h*w), 3*2*14*14]`` patch rows (Qwen-VL's patch layout) with ``image_grid_thw`` (1, h, w).
- video: ``<|begin_of_video|>`` then per temporal patch (2 frames) an image-token run of h*w/4
  between ``<|begin_of_image|>`` / ``<|end_of_image|>`` and its timestamp text, then
  ``<|end_of_video|>``; ``pixel_values_videos`` with ``video_grid_thw`` (t, h, w): t runs, each
  one item of the guard (its video is their model-level item). The video markers stay text to the
  guard (they would nest the frames' image regions); ``mm_token_type_ids`` (1 image, 2 video)
  is what tells a frame run from an image run.

The plain model scatters images and videos into every image-token position in turn, so it
cannot take a batch with both; the guard merges per run in token order. The forward takes one
of ``input_ids`` / ``inputs_embeds`` and computes no M-RoPE from embeddings: the guard passes
``position_ids`` from the model's own ``get_rope_index`` on the rewritten ids and kept grids.
Image repair: the image processor's ``smart_resize`` (an image is a clip of 2 frames:
``PatchMergeGeometry`` with ``temporal_budget``), re-encoded through ``get_image_features``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..geometry import PatchMergeGeometry
from .mrope import grid_counts, image_encoder, patch_dummy, rope_positions
from .spec import Encoded, FamilySpec, ModalitySpec, Token, bridge_embed

PATCH, TEMPORAL, MERGE = 14, 2, 2
_encode_image, _reencode_image = image_encoder(PATCH, TEMPORAL, MERGE)


def _encode_video(model: Any, kw) -> Encoded:
    pv, grid = kw["pixel_values_videos"], kw["video_grid_thw"]
    out = model.get_video_features(pv, grid, return_dict=True).pooler_output
    # one item per video, its t frame runs counted on the device: the engine cuts it into
    # them once the merge's one transfer brought t (no read of the grids here)
    feats = tuple(out)
    return Encoded(feats, num_frames=(TEMPORAL,) * len(feats), runs=grid[:, 0])


@dataclass(frozen=True)
class ClipGeometry:
    """A patch-merge geometry that sizes an image as a clip of ``frames`` frames (GLM-4V's
    ``smart_resize(num_frames=temporal_patch_size, ...)``)."""

    geo: PatchMergeGeometry
    frames: int = TEMPORAL

    def solve(
        self, target_tokens: int, hw: tuple[int, int], num_frames: int = 1, *, hw_kind="source"
    ):
        return self.geo.solve(target_tokens, hw, max(num_frames, self.frames), hw_kind=hw_kind)

    def tokens(self, hw: tuple[int, int], num_frames: int = 1) -> int:
        return self.geo.tokens(hw, max(num_frames, self.frames))


def geometry(model: Any = None) -> ClipGeometry:
    """``Glm4vImageProcessor``'s sizing (factor 28; ``size`` = 112*112 .. 28*28*15000 pixels)."""
    return ClipGeometry(
        PatchMergeGeometry(
            patch=PATCH,
            merge=MERGE,
            temporal_patch=TEMPORAL,
            min_pixels=112 * 112,
            max_pixels=28 * 28 * 15000,
            temporal_budget=True,
        )
    )


_IMAGE = Token(("image_token_id",), "<|image|>")

MODALITIES = (
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
)

SPEC = FamilySpec(
    name="glm4v",
    classes={
        "transformers.": frozenset(
            f"{p}{s}" for p in ("Glm4v", "Glm4vMoe") for s in ("ForConditionalGeneration", "Model")
        )
    },
    modalities=MODALITIES,
    text=Token(("text_config.pad_token_id", "pad_token_id"), "<|endoftext|>", 151329),
    geometry=geometry,
    follow_ids=("mm_token_type_ids",),
    token_types="mm_token_type_ids",
    positions=rope_positions,
    ids_with_embeds=False,
    dummy=patch_dummy("visual"),
)

#: Megatron-Bridge 0.6.2 ``GLM45VModel.forward(input_ids, attention_mask, position_ids,
#: inputs_embeds, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw,
#: mm_token_type_ids, ...)``: it merges only while pixels are given and always computes its
#: M-RoPE itself (``get_rope_index`` on ``input_ids``, ``mm_token_type_ids`` and the grids,
#: ``position_ids`` ignored): the guard passes the ids with the embeddings and no positions
BRIDGE = replace(
    SPEC,
    classes={"megatron.bridge.": frozenset({"GLM45VModel"})},
    positions=None,
    ids_with_embeds=True,
    embed=bridge_embed,
)
