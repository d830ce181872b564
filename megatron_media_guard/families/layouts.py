"""Pixel layouts the family specs share: how a processor's flat patch rows map back to an image
(for repair, which resizes images) and forward again."""

from __future__ import annotations

import torch

PATCH = 16


def patches_to_image(rows: torch.Tensor, gh: int, gw: int, patch: int = PATCH) -> torch.Tensor:
    """``[gh*gw, C*p*p]`` patch rows (row-major patches, channel-major within a patch: the
    RADIO processor's) -> ``[C, p*gh, p*gw]`` pixels."""
    c = rows.shape[1] // (patch * patch)
    x = rows.reshape(gh, gw, c, patch, patch).permute(2, 0, 3, 1, 4)
    return x.reshape(c, gh * patch, gw * patch)


def image_to_patches(img: torch.Tensor, patch: int = PATCH) -> torch.Tensor:
    """``[C, H, W]`` (H, W multiples of ``patch``) -> ``[(H/p)*(W/p), C*p*p]`` patch rows."""
    c, h, w = img.shape
    x = img.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4)
    return x.reshape((h // patch) * (w // patch), c * patch * patch)
