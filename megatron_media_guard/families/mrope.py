"""What the M-RoPE families with Qwen-VL patch rows share (GLM-4V, Ernie 4.5 VL): images in
the ``qwen_patches`` layout with ``image_grid_thw``, ``position_ids`` from the model's own
``get_rope_index``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MediaInputError
from ..repair.pixels import from_frames, to_frames
from .common import grid_table, patch_images, tower_dummy
from .spec import Counts, Encoded


def image_encoder(patch: int, temporal: int, merge: int):
    """``(encode, reencode)`` for images in patch rows of ``temporal`` frames a patch; an
    image's pixels are the first of the ``tp`` frames the processor repeated."""
    layout = dict(patch=patch, temporal_patch=temporal, merge=merge)

    def image(rows: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return to_frames(rows, "qwen_patches", grid_thw=(1, h, w), **layout)[0]

    def encode(model: Any, kw) -> Encoded:
        pv, grid = kw["pixel_values"], kw["image_grid_thw"]
        feats = model.get_image_features(pv, grid, return_dict=True).pooler_output
        return patch_images(feats, kw, "pixel_values", "image_grid_thw", patch, image)

    def reencode(model: Any, img: torch.Tensor) -> torch.Tensor:
        grid = [[1, img.shape[-2] // patch, img.shape[-1] // patch]]
        grid = torch.tensor(grid, dtype=torch.long, device=img.device)
        rows, _ = from_frames(img[None], "qwen_patches", **layout)
        return model.get_image_features(rows, grid, return_dict=True).pooler_output[0]

    return encode, reencode


def rope_positions(model: Any, kw) -> torch.Tensor:
    """``position_ids`` ``[3, b, s]`` from the model's own ``get_rope_index`` (on the
    ``...ForConditionalGeneration``'s ``.model``, or the model itself)."""
    if kw.get("mm_token_type_ids") is None:
        raise MediaInputError(
            "mm_token_type_ids is missing: the guard computes the M-RoPE positions from it "
            "(the processor returns it alongside input_ids)"
        )
    inner = getattr(model, "model", model)
    return inner.get_rope_index(
        kw["input_ids"],
        kw["mm_token_type_ids"],
        kw.get("image_grid_thw"),
        kw.get("video_grid_thw"),
        attention_mask=kw.get("attention_mask"),
    )[0]


def grid_counts(grid: str, per_run: bool, div: int = 4, patch: int = 14) -> Counts:
    """``counts`` from a grid input (:func:`~.common.grid_table`; ``per_run``: t runs)."""
    return lambda config, kw: grid_table(kw[grid], div, patch, "runs" if per_run else "tokens")


def patch_dummy(tower: str):
    """A spec's ``dummy`` for patch-row towers: one ``merge x merge`` patch image of zeros
    through the model's own ``get_image_features`` (deepstack too)."""

    def cell(v: Any) -> tuple[int, int]:
        m, p, tp = v.spatial_merge_size, v.patch_size, getattr(v, "temporal_patch_size", 1)
        return m * m, v.in_channels * tp * p * p

    def grid(v: Any) -> list:
        return [[1, v.spatial_merge_size, v.spatial_merge_size]]

    return tower_dummy("get_image_features", cell, grid, tower)
