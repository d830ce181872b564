"""What the M-RoPE families with Qwen-VL style patch rows share (GLM-4V, Ernie 4.5 VL): images
as ``[sum(t*h*w), C*tp*p*p]`` patch rows with ``image_grid_thw`` (rows ``(t, h/m, w/m, m, m)``,
each patch ``(C, tp, p, p)``: the ``qwen_patches`` layout of ``repair.pixels``), per-item
features from the model's own ``get_image_features``, and
``position_ids`` from the model's own ``get_rope_index`` on the rewritten ids and kept grids.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.host import to_host
from ..errors import MediaInputError
from ..repair.pixels import from_frames, to_frames
from .spec import Encoded, count_table, split_rows, tower_zeros


def rows_to_image(rows: torch.Tensor, h: int, w: int, p: int, tp: int, m: int) -> torch.Tensor:
    """One image's ``[h*w, C*tp*p*p]`` patch rows (grid ``(1, h, w)``) -> ``[C, h*p, w*p]``
    (the first of the ``tp`` frames the processor repeated): ``repair.pixels``' layout."""
    frames = to_frames(
        rows, "qwen_patches", grid_thw=(1, h, w), patch=p, temporal_patch=tp, merge=m
    )
    return frames[0]


def image_to_rows(img: torch.Tensor, p: int, tp: int, m: int) -> torch.Tensor:
    """``[C, H, W]`` (multiples of ``p*m``) -> ``[(H/p)*(W/p), C*tp*p*p]`` patch rows, the
    image repeated over the ``tp`` frames of a temporal patch as the processor does."""
    rows, _ = from_frames(img[None], "qwen_patches", patch=p, temporal_patch=tp, merge=m)
    return rows


def image_encoder(patch: int, temporal: int, merge: int):
    """``(encode, reencode)`` for images in patch rows of ``temporal`` frames a patch."""

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
            pix.append(rows_to_image(rows, h, w, patch, temporal, merge))
            off += t * h * w
        return Encoded(
            feats,
            num_frames=(None,) * len(thw),
            frame_hw=tuple((patch * h, patch * w) for _, h, w in thw),
            pixels=tuple(pix),
        )

    def reencode(model: Any, img: torch.Tensor) -> torch.Tensor:
        grid = [[1, img.shape[-2] // patch, img.shape[-1] // patch]]
        grid = torch.tensor(grid, dtype=torch.long, device=img.device)
        out = model.get_image_features(
            image_to_rows(img, patch, temporal, merge), grid, return_dict=True
        )
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


def grid_counts(grid: str, per_run: bool, div: int = 4, patch: int = 14):
    """``counts`` for the collate check from a ``[n, 3]`` (t, h, w) grid input: one run of
    t*h*w/``div`` per item, or (``per_run``: GLM-4V's video frames) t runs of h*w/``div``; at
    ``patch * (h, w)`` pixels."""

    def counts(config: Any, kw) -> torch.Tensor:
        thw = kw[grid].long()
        t, hw = thw[:, 0], thw[:, 1:]
        if per_run:
            return count_table(hw.prod(-1) // div, runs=t, hw=hw * patch, grid=thw)
        return count_table(thw.prod(-1) // div, hw=hw * patch, grid=thw)

    return counts


def patch_dummy(tower: str):
    """A spec's ``dummy`` for patch-row towers: one ``merge x merge`` patch image of zeros
    (``[m*m, C*tp*p*p]``, grid ``[[1, m, m]]``) through the model's own
    ``get_image_features`` (tower and merger; its whole output kept, deepstack features too),
    ``tp`` the config's temporal patch (1 if none)."""

    def dummy(model: Any):
        v = model.config.vision_config
        m, p, tp = v.spatial_merge_size, v.patch_size, getattr(v, "temporal_patch_size", 1)
        pv = tower_zeros(model, tower, m * m, v.in_channels * tp * p * p)
        grid = torch.tensor([[1, m, m]], device=pv.device)
        return model.get_image_features(pv, grid, return_dict=True)

    return dummy
