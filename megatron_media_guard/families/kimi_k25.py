"""Kimi K2.5 (``Kimi_K25ForConditionalGeneration``; Bridge ``KimiK25VLModel``, images only):
grammar and counts: docs/FAMILIES.md. A video chunk of <= 4 frames is one ``video_grid_thw``
row and one item. No repair (``navit_resize`` needs torchvision: no oracle can pin it here).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .common import PAD, feature_call, grid_table, hf_classes, tower_dummy
from .spec import Encoded, FamilySpec, Merged, ModalitySpec, Token, attr_path, tower_zeros


def _counts(grid: str):
    """One run of ``h*w / (mh*mw)`` per grid row ``(t, h, w)``, its ``t`` frames mean-pooled."""

    def counts(config: Any, kw) -> torch.Tensor:
        v = attr_path(config, "vision_config", "vision_tower_config") or config
        (mh, mw), p = v.merge_kernel_size, int(v.patch_size)
        return grid_table(kw[grid], mh * mw, p, "frames")

    return counts


def _embed(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """As ``Kimi_K25Model.forward``: placeholder ids become 0 before the embedding."""
    cfg = model.config
    mm = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
    return model.get_input_embeddings()(ids.masked_fill(mm, 0))


def _cell(v: Any) -> tuple[int, ...]:  # a dummy's zeros: one merge cell of patches
    (mh, mw), p = v.merge_kernel_size, v.patch_size
    return mh * mw, 3, p, p


_MARKERS = dict(
    start=Token(("vision_start_token_id",), "<|media_begin|>"),
    end=Token(("vision_end_token_id",), "<|media_end|>"),
)

SPEC = FamilySpec(
    name="kimi_k25",
    classes=hf_classes("Kimi_K25"),
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<|media_pad|>"),
            ("pixel_values", "image_grid_thw"),
            feature_call("get_image_features", "pixel_values", "image_grid_thw"),
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=_counts("image_grid_thw"),
            **_MARKERS,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|kimi_k25_video_placeholder|>"),
            ("pixel_values_videos", "video_grid_thw"),
            feature_call("get_video_features", "pixel_values_videos", "video_grid_thw"),
            rows=("video_grid_thw",),
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=_counts("video_grid_thw"),
            **_MARKERS,
        ),
    ),
    text=Token(PAD, "[PAD]", 0),
    embed=_embed,
    # one cell through the tower and the projector
    dummy=tower_dummy("get_image_features", _cell, lambda v: [[1, *v.merge_kernel_size]]),
)


def _encode_bridge(model: Any, kw) -> Encoded:
    pv = kw["pixel_values"].to(model.vision_tower.dtype)  # as Bridge's forward
    return Encoded(tuple(model._extract_image_features(pv, kw["image_grid_thw"])))


def _bridge_after_merge(model: Any, merged: Merged) -> dict:
    """What Bridge's forward skips with its merge (given embeddings and no pixels):
    ``position_ids`` from the attention mask (else the ids against ``pad_token_id``), labels
    ignored on the placeholders, no attention mask (its language model attends causally)."""
    kw, cfg = merged.kwargs, model.config
    ids, mask = kw["input_ids"], kw.get("attention_mask")
    if mask is None:
        mask = (ids != cfg.pad_token_id).long()
    out = {"position_ids": (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1), "attention_mask": None}
    if isinstance(kw.get("labels"), torch.Tensor):
        ph = ids == model.media_placeholder_token_id
        out["labels"] = kw["labels"].masked_fill(ph, cfg.ignore_index)
    return out


def _bridge_dummy(model: Any):  # one cell through Bridge's tower
    v = model.vision_tower_config
    pv = tower_zeros(model, "vision_tower", *_cell(v))
    return model._extract_image_features(
        pv, torch.tensor([[1, *v.merge_kernel_size]], device=pv.device)
    )


#: Megatron-Bridge 0.6.2 ``KimiK25VLModel``: images only, on ``media_placeholder_token_id``,
#: its own ``_extract_image_features`` and embedding
BRIDGE = SPEC.bridge(
    "KimiK25VLModel",
    modalities=(
        replace(
            SPEC.modalities[0],
            placeholder=Token(("media_placeholder_token_id", "image_token_id"), "<|media_pad|>"),
            encode=_encode_bridge,
        ),
    ),
    text=Token(("pad_token_id",), "[PAD]", 0),
    after_merge=_bridge_after_merge,
    dummy=_bridge_dummy,
)
