"""LLaVA-OneVision (transformers ``LlavaOnevisionForConditionalGeneration`` /
``LlavaOnevisionModel``; Megatron-Bridge 0.6.2 has no class for it).

- image: a bare run of ``<image>`` (``config.image_token_id``) per image, no markers. Its count
  is the model's own: anyres (the best pinpoint for ``image_sizes[n]``, unpadded, capped by
  ``anyres_max_k``, one newline feature per row, the base tile first), or base + 1 for an image
  of a sample with several (``batch_num_images[s] > 1``). ``pixel_values``
  ``[n, max_tiles, 3, S, S]``, ``image_sizes`` ``[n, 2]`` original (H, W), ``batch_num_images``
  ``[samples with images]``.
- video: a bare run of ``<video>`` per video, frames * ceil(side/2)^2 + 1;
  ``pixel_values_videos`` ``[v, frames, 3, S, S]`` stacked. Images are consumed before videos.

The tower runs once on the whole call, with the caller's ``batch_num_images``: a dropped
sample's items are left unplaced and nothing is encoded again, so a kept multi-image sample
keeps its base + 1 counts (re-encoding after removing one image of a two-image sample would
turn its sibling anyres: another count and tiles ``pixel_values`` does not hold).

No repair geometry: an anyres count is many-to-one in the image size (pinpoint choice,
unpadding, the anyres_max cap) and its tiles are cut from the original image, which the
model never receives; a multi-image count (base + 1) does not depend on the size at all.
"""

from __future__ import annotations

from typing import Any

from .spec import Encoded, FamilySpec, ModalitySpec, Token, tower_zeros


def _encode_image(model: Any, kw) -> Encoded:
    out = model.get_image_features(
        kw["pixel_values"],
        kw["image_sizes"],
        vision_feature_layer=kw.get("vision_feature_layer"),
        vision_feature_select_strategy=kw.get("vision_feature_select_strategy"),
        batch_num_images=kw.get("batch_num_images"),
        return_dict=True,
    )
    return Encoded(tuple(out.pooler_output))  # one [N_q, h] per image, newlines included


def _encode_video(model: Any, kw) -> Encoded:
    out = model.get_video_features(
        kw["pixel_values_videos"],
        vision_feature_layer=kw.get("vision_feature_layer"),
        vision_feature_select_strategy=kw.get("vision_feature_select_strategy"),
        return_dict=True,
    )
    return Encoded(tuple(out.pooler_output))  # [v, N, h]: one row per video


def _dummy(model: Any):
    """One video frame of zeros (a single tile: no anyres pinpoint to match) through the tower,
    the projector and the pooling, as the spec's video encode runs them."""
    size = int(model.config.vision_config.image_size)
    pv = tower_zeros(model, "vision_tower", 1, 1, 3, size, size)
    return model.get_video_features(pv, return_dict=True).pooler_output


SPEC = FamilySpec(
    name="llava_onevision",
    classes={
        "transformers.": frozenset(
            {"LlavaOnevisionForConditionalGeneration", "LlavaOnevisionModel"}
        ),
    },
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id", "image_token_index"), "<image>"),
            (
                "pixel_values",
                "image_sizes",
                "batch_num_images",
                "vision_feature_layer",
                "vision_feature_select_strategy",
            ),
            _encode_image,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id", "video_token_index"), "<video>"),
            ("pixel_values_videos", "image_sizes_videos"),
            _encode_video,
        ),
    ),
    text=Token(("text_config.pad_token_id", "pad_token_id"), "<|endoftext|>", 0),
    ids_with_embeds=False,
    dummy=_dummy,
)
