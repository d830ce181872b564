"""Kimi K2.5 (transformers ``Kimi_K25ForConditionalGeneration``): MoonViT images and video
chunks, time-pooled.

- image: ``<|media_begin|>`` "image" ``<|media_content|>`` ``<|media_pad|>``x(h*w/4)
  ``<|media_end|>``; ``pixel_values`` ``[sum(t*h*w), 3, 14, 14]`` with ``image_grid_thw`` rows
  ``(1, h, w)``.
- video: per chunk of <= 4 frames, its timestamp text, ``<|media_begin|>`` "video"
  ``<|media_content|>`` ``<|kimi_k25_video_placeholder|>``x(h*w/4) ``<|media_end|>``: one
  ``video_grid_thw`` row ``(t, h, w)`` per chunk, its frames mean-pooled to h*w/4 features. The
  processor pops ``num_chunks_per_video``: a chunk is the item (``set_items``: one per chunk).
- both markers and placeholders come from the config (``vision_start_token_id``,
  ``vision_end_token_id``, ``image_token_id``, ``video_token_id``); images and videos have
  placeholders of their own, so a mixed batch's runs are told apart by their token.
- the model embeds its placeholder ids as id 0 (the video placeholder id can lie past the text
  vocabulary): the guard embeds the same way.

Repair: none. The processors resize by ``navit_resize`` (a patch budget and a per-side cap,
never upscaling, then *padding* to a multiple of 28); they need torchvision, so no oracle test
can pin that arithmetic here, and a repair falls back ("no geometry for kimi_k25").

Bridge 0.6.2's ``KimiK25VLModel`` is not registered: its class builds from remote code, so it
cannot run here, and an adapter is not claimed for a class it never ran on. (Its forward takes
images only, on ``media_placeholder_token_id``, through its own ``_extract_image_features``.)
"""

from __future__ import annotations

from typing import Any

import torch

from .spec import Encoded, FamilySpec, ModalitySpec, Token, tower_zeros


def _encode_image(model: Any, kw) -> Encoded:
    out = model.get_image_features(kw["pixel_values"], kw["image_grid_thw"], return_dict=True)
    return Encoded(tuple(out.pooler_output))  # one [h*w/4, hidden] per grid row


def _encode_video(model: Any, kw) -> Encoded:
    pv, grid = kw["pixel_values_videos"], kw["video_grid_thw"]
    out = model.get_video_features(pv, grid, return_dict=True)
    return Encoded(tuple(out.pooler_output))  # one per chunk (grid row)


def _embed(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """As ``Kimi_K25Model.forward``: placeholder ids become 0 before the embedding."""
    cfg = model.config
    mm = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
    return model.get_input_embeddings()(ids.masked_fill(mm, 0))


def _dummy(model: Any):  # one 2x2-patch image of zeros through the tower and the projector
    v = model.config.vision_config
    (mh, mw), p = v.merge_kernel_size, v.patch_size
    pv = tower_zeros(model, "vision_tower", mh * mw, 3, p, p)
    grid = torch.tensor([[1, mh, mw]], device=pv.device)
    return model.get_image_features(pv, grid, return_dict=True).pooler_output


_START = Token(("vision_start_token_id",), "<|media_begin|>")
_END = Token(("vision_end_token_id",), "<|media_end|>")

SPEC = FamilySpec(
    name="kimi_k25",
    classes={"transformers.": frozenset({"Kimi_K25ForConditionalGeneration", "Kimi_K25Model"})},
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<|media_pad|>"),
            ("pixel_values", "image_grid_thw"),
            _encode_image,
            start=_START,
            end=_END,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|kimi_k25_video_placeholder|>"),
            ("pixel_values_videos", "video_grid_thw"),
            _encode_video,
            start=_START,
            end=_END,
        ),
    ),
    text=Token(("text_config.pad_token_id", "pad_token_id"), "[PAD]", 0),
    embed=_embed,
    dummy=_dummy,
)
