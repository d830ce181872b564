"""Kimi K2.5 (transformers ``Kimi_K25ForConditionalGeneration``; Megatron-Bridge
``KimiK25VLModel``): MoonViT images and video chunks, time-pooled.

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

Bridge 0.6.2's ``KimiK25VLModel.forward(input_ids, attention_mask, position_ids, inputs_embeds,
pixel_values, image_grid_thw, labels, ...)`` (:data:`BRIDGE`): images only, on its provider's
``media_placeholder_token_id`` (the markers from the tokenizer), through its own
``_extract_image_features`` (one tensor per grid row), embedded by its language model. Given
``inputs_embeds`` and no pixels it skips its merge and what goes with it; the guard redoes that
part (:func:`_bridge_after_merge`): positions from the attention mask, labels ignored on the
placeholders, no attention mask to the language model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .spec import (
    Encoded,
    FamilySpec,
    Merged,
    ModalitySpec,
    Token,
    attr_path,
    bridge_embed,
    count_table,
    tower_zeros,
)


def _encode_image(model: Any, kw) -> Encoded:
    out = model.get_image_features(kw["pixel_values"], kw["image_grid_thw"], return_dict=True)
    return Encoded(tuple(out.pooler_output))  # one [h*w/4, hidden] per grid row


def _encode_video(model: Any, kw) -> Encoded:
    pv, grid = kw["pixel_values_videos"], kw["video_grid_thw"]
    out = model.get_video_features(pv, grid, return_dict=True)
    return Encoded(tuple(out.pooler_output))  # one per chunk (grid row)


def _counts(grid: str):
    """One run of ``h*w / (mh*mw)`` per ``(t, h, w)`` grid row (a video chunk's frames
    mean-pooled: ``t`` is its frames), at ``patch * (h, w)`` pixels."""

    def counts(config: Any, kw) -> torch.Tensor:
        v = attr_path(config, "vision_config", "vision_tower_config") or config
        (mh, mw), p = v.merge_kernel_size, int(v.patch_size)
        thw = kw[grid].long()
        n = thw[:, 1] * thw[:, 2] // (mh * mw)
        return count_table(n, frames=thw[:, 0], hw=thw[:, 1:] * p, grid=thw)

    return counts


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
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=_counts("image_grid_thw"),
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|kimi_k25_video_placeholder|>"),
            ("pixel_values_videos", "video_grid_thw"),
            _encode_video,
            start=_START,
            end=_END,
            rows=("video_grid_thw",),
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=_counts("video_grid_thw"),
        ),
    ),
    text=Token(("text_config.pad_token_id", "pad_token_id"), "[PAD]", 0),
    embed=_embed,
    dummy=_dummy,
)


def _encode_bridge(model: Any, kw) -> Encoded:
    pv = kw["pixel_values"].to(model.vision_tower.dtype)  # as Bridge's forward
    return Encoded(tuple(model._extract_image_features(pv, kw["image_grid_thw"])))


def _bridge_after_merge(model: Any, merged: Merged) -> dict:
    """Bridge's pre-expanded merge beside the scatter: ``position_ids`` from the attention mask
    (else from the ids against ``pad_token_id``), labels ``ignore_index`` on the placeholders,
    the attention mask dropped (its language model attends causally). A dropped sample's
    placeholders are text here already and its labels ignored."""
    kw, cfg = merged.kwargs, model.config
    ids, mask = kw["input_ids"], kw.get("attention_mask")
    if mask is None:
        mask = (ids != cfg.pad_token_id).long()
    out = {"position_ids": (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1), "attention_mask": None}
    if isinstance(kw.get("labels"), torch.Tensor):
        ph = ids == model.media_placeholder_token_id
        out["labels"] = kw["labels"].masked_fill(ph, cfg.ignore_index)
    return out


def _bridge_dummy(model: Any):  # one 2x2-patch image of zeros through Bridge's tower
    v = model.vision_tower_config
    (mh, mw), p = v.merge_kernel_size, v.patch_size
    pv = tower_zeros(model, "vision_tower", mh * mw, 3, p, p)
    return model._extract_image_features(pv, torch.tensor([[1, mh, mw]], device=pv.device))


#: Megatron-Bridge 0.6.2 ``KimiK25VLModel``: images only, its own feature path and embedding
BRIDGE = replace(
    SPEC,
    classes={"megatron.bridge.": frozenset({"KimiK25VLModel"})},
    modalities=(
        replace(
            SPEC.modalities[0],
            placeholder=Token(("media_placeholder_token_id", "image_token_id"), "<|media_pad|>"),
            encode=_encode_bridge,
        ),
    ),
    text=Token(("pad_token_id",), "[PAD]", 0),
    embed=bridge_embed,
    after_merge=_bridge_after_merge,
    dummy=_bridge_dummy,
)
