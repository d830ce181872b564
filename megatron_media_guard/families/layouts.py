"""RADIO's patch rows (row-major patches, channel-major within a patch: Nemotron Omni's
processor) as the ``qwen_patches`` layout of ``repair.pixels`` with no temporal patch and no
merge: the image back from them (for repair, which resizes images) and forward again."""

from __future__ import annotations

import torch

from ..repair.pixels import from_frames, to_frames

PATCH = 16
_RADIO = dict(temporal_patch=1, merge=1)


def patches_to_image(rows: torch.Tensor, gh: int, gw: int, patch: int = PATCH) -> torch.Tensor:
    """``[gh*gw, C*p*p]`` patch rows -> ``[C, p*gh, p*gw]`` pixels."""
    return to_frames(rows, "qwen_patches", grid_thw=(1, gh, gw), patch=patch, **_RADIO)[0]


def image_to_patches(img: torch.Tensor, patch: int = PATCH) -> torch.Tensor:
    """``[C, H, W]`` (H, W multiples of ``patch``) -> ``[(H/p)*(W/p), C*p*p]`` patch rows."""
    return from_frames(img[None], "qwen_patches", patch=patch, **_RADIO)[0]
