"""LLaVA-OneVision's anyres pixels as torch ops (on the pixels' device): the image back from
its tiles, and an image cut into tiles the way ``LlavaOnevisionImageProcessor`` cuts them.

The processor resizes an image into its best pinpoint (aspect kept, ``get_patch_output_size``),
pads it centred to the pinpoint with zero pixels, splits that canvas row-major into tiles of
the tower's size and puts the whole image resized to one tile first. So the tiles of an image
stitched back, with the padding cut, are exactly the resized image the processor made (up to
nothing: the split is a reshape). The padding is the processor's zero pixel normalized with
its default mean/std (OPENAI_CLIP; a processor configured with others pads to another value).
"""

from __future__ import annotations

import torch

from ..geometry import AnyresGeometry
from ..geometry.anyres import best_resolution, fitted_size
from ..repair.reproject import resize_frames

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


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
