"""What the M-RoPE families with Qwen-VL style patch rows share (GLM-4V, Ernie 4.5 VL): images
as ``[sum(t*h*w), C*tp*p*p]`` patch rows with ``image_grid_thw`` (``repair.pixels``'
``qwen_patches`` layout), per-item features from the model's own ``get_image_features``, and
``position_ids`` from the model's own ``get_rope_index`` on the rewritten ids and kept grids.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.host import to_host
from ..errors import MediaInputError
from ..repair.pixels import from_frames, to_frames
from .spec import Encoded, split_rows


def image_encoder(patch: int, temporal: int, merge: int):
    """``(encode, reencode)`` for images in patch rows of ``temporal`` frames a patch."""
    qwen = {"patch": patch, "temporal_patch": temporal, "merge": merge}

    def encode(model: Any, kw) -> Encoded:
        pv, grid = kw["pixel_values"], kw["image_grid_thw"]
        feats = model.get_image_features(pv, grid, return_dict=True).pooler_output
        feats = split_rows(feats, [])
        if not kw.get("_media_guard_pixels"):
            return Encoded(feats)
        # repair only: the grids on the host to cut each image's patch rows (one transfer)
        thw = to_host(grid, why="image grids to cut each item's patch rows for repair").tolist()
        pix, off = [], 0
        for t, h, w in thw:
            rows = pv[off : off + t * h * w]
            pix.append(to_frames(rows, "qwen_patches", grid_thw=(t, h, w), **qwen)[0])
            off += t * h * w
        return Encoded(
            feats,
            num_frames=(None,) * len(thw),
            frame_hw=tuple((patch * h, patch * w) for _, h, w in thw),
            pixels=tuple(pix),
        )

    def reencode(model: Any, img: torch.Tensor) -> torch.Tensor:
        frames = img[None].expand(temporal, -1, -1, -1)  # the processor repeats an image
        patches, kw = from_frames(frames, "qwen_patches", **qwen)
        out = model.get_image_features(patches, kw["grid_thw"], return_dict=True)
        return out.pooler_output[0]

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
