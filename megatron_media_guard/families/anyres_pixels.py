"""LLaVA-OneVision's anyres pixels as torch ops: the image back from its tiles, an image cut
into tiles as ``LlavaOnevisionImageProcessor`` does, and its spec's ``counts``.

The processor resizes an image into its best pinpoint, pads it centred with its zero pixel
(normalized with its default OPENAI_CLIP mean/std), splits it row-major into tiles and puts
the whole image resized to one tile first: the tiles stitched back, padding cut, are exactly
the resized image (the split is a reshape).
"""

from __future__ import annotations

from typing import Any

import torch

from ..geometry import AnyresGeometry
from ..geometry.anyres import best_resolution, fitted_size
from ..repair.reproject import resize_frames
from .pinning import CLIP_MEAN as MEAN
from .pinning import CLIP_STD as STD
from .spec import count_table


def stitch(geo: AnyresGeometry, tiles: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The image the processor cut ``tiles`` (base first) from: resized into its pinpoint."""
    bh, bw = best_resolution(h, w, geo.pinpoints)
    rows, cols = bh // geo.tile, bw // geo.tile
    grid = tiles[1 : 1 + rows * cols].unflatten(0, (rows, cols))  # [r, c, C, T, T]
    canvas = grid.permute(2, 0, 3, 1, 4).reshape(tiles.shape[1], bh, bw)
    nh, nw = fitted_size(h, w, (bh, bw))
    top, left = (bh - nh) // 2, (bw - nw) // 2
    return canvas[:, top : top + nh, left : left + nw]


def tiles_for(geo: AnyresGeometry, img: torch.Tensor) -> torch.Tensor:
    """``[1 + r * c, C, T, T]``: an image ``[C, H, W]`` as the processor tiles it (the whole
    image resized to one tile; then resized into its best pinpoint, padded with the
    processor's zero pixel, split row-major)."""
    (h, w), t = img.shape[-2:], geo.tile
    bh, bw = best_resolution(h, w, geo.pinpoints)
    nh, nw = fitted_size(h, w, (bh, bw))
    canvas = (-torch.tensor(MEAN) / torch.tensor(STD)).to(img)[:, None, None].repeat(1, bh, bw)
    top, left = (bh - nh) // 2, (bw - nw) // 2
    canvas[:, top : top + nh, left : left + nw] = resize_frames(img[None], (nh, nw))[0]
    grid = canvas.unflatten(1, (bh // t, t)).unflatten(3, (bw // t, t)).permute(1, 3, 0, 2, 4)
    return torch.cat([resize_frames(img[None], (t, t)), grid.flatten(0, 1)])


def anyres_tokens(sizes: torch.Tensor, multi: torch.Tensor, config: Any) -> torch.Tensor:
    """Per ``image_sizes`` row ``(H, W)``, the features ``pack_image_features`` makes (torch,
    float64: Python's arithmetic): ``base + 1`` where ``multi``, else the best pinpoint's
    unpadded map, the ``anyres_max_k`` downscale and a newline per row after the base tile."""
    v = config.vision_config
    tile, side = int(v.image_size), int(v.image_size) // int(v.patch_size)
    k = int(config.vision_aspect_ratio.removeprefix("anyres_max_"))
    f64 = dict(dtype=torch.float64, device=sizes.device)
    h, w = sizes.to(**f64).unbind(-1)
    pins = torch.tensor(config.image_grid_pinpoints, **f64)  # [P, 2] (H, W)
    ph, pw = pins[:, 0], pins[:, 1]
    scale = torch.minimum(pw / w[:, None], ph / h[:, None])  # [n, P]
    eff = torch.minimum(
        torch.trunc(w[:, None] * scale) * torch.trunc(h[:, None] * scale), (w * h)[:, None]
    )
    waste = ph * pw - eff
    best = eff == eff.max(1, keepdim=True).values
    waste = torch.where(best, waste, torch.inf)
    pick = (best & (waste == waste.min(1, keepdim=True).values)).int().argmax(1)
    cur_h, cur_w = side * (ph[pick] // tile), side * (pw[pick] // tile)
    wider = w / h > cur_w / cur_h
    new_h = torch.trunc(torch.round(h * (cur_w / w), decimals=7))
    new_w = torch.trunc(torch.round(w * (cur_h / h), decimals=7))
    cut_h = 2 * torch.div(cur_h - new_h, 2, rounding_mode="floor")  # the unpadded map
    cut_w = 2 * torch.div(cur_w - new_w, 2, rounding_mode="floor")
    cur_h = torch.where(wider, cur_h - cut_h, cur_h)
    cur_w = torch.where(wider, cur_w, cur_w - cut_w)
    ratio = torch.sqrt(cur_h * cur_w / (k * side**2))
    down = ratio > 1.1
    cur_h = torch.where(down, torch.div(cur_h, ratio, rounding_mode="floor"), cur_h)
    cur_w = torch.where(down, torch.div(cur_w, ratio, rounding_mode="floor"), cur_w)
    n = side**2 + cur_h * (cur_w + 1)
    return torch.where(multi, side**2 + 1, n).long()


def image_counts(config: Any, kw) -> torch.Tensor:
    """:func:`anyres_tokens` of each image, multi-image where ``batch_num_images`` says its
    sample has several (the model's ``need_patching``), at its original size."""
    sizes, bni = kw["image_sizes"], kw.get("batch_num_images")
    n = sizes.shape[0]
    if bni is None:
        multi = torch.zeros(n, dtype=torch.bool, device=sizes.device)
    else:
        bni = torch.as_tensor(bni, device=sizes.device)
        multi = torch.repeat_interleave(bni > 1, bni, output_size=n)
    return count_table(anyres_tokens(sizes, multi, config), hw=sizes)


def video_counts(config: Any, kw) -> torch.Tensor:
    """``frames * ceil(side / 2)**2 + 1`` per stacked video (its pooling, one newline)."""
    pv = kw["pixel_values_videos"]
    v, frames = pv.shape[:2]
    side = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    n = torch.full((v,), frames * (-(-side // 2)) ** 2 + 1, device=pv.device)
    return count_table(n, frames=frames, hw=tuple(pv.shape[-2:]))
