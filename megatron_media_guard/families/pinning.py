"""How one original image is processed at a solved size, the way each family's processor does
it: the data side's repair (:mod:`.reprocess`) re-processes an item from its original so that
its pixels and grid are what the processor makes of it at the engine's size.

- :class:`PatchMergePin` (Qwen-VL, GLM-4V, Ernie 4.5 VL; transformers' ``...ImageProcessor`` /
  ``...ImageProcessorPil``): the processor's own budget knobs pin the size where they can
  (``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``, per call: the
  processor's settings are never changed); else the original is resized to the solved size by
  the processor's own backend ``resize`` with its own resampling, then processed with
  ``do_resize=False``.
- :class:`RadioPin` (Nemotron Omni): its processor imports torchvision (no CPU build here), so
  the library's own implementation of its arithmetic: the image as the processor reads it
  (RGB, channels first), float32, resized to ``16*grid`` by :func:`~..repair.reproject.
  resize_frames` (bicubic, antialias: the processor's float resize), rescaled and normalized
  with the mean and std scaled by ``1/rescale_factor`` (its fused rescale-and-normalize), cut
  into row-major patches (:func:`.layouts.image_to_patches`). A processor passed in lends its
  ``image_mean`` / ``image_std`` / ``rescale_factor`` / ``patch_size``.

Each ``run(processor, original, solution)`` returns a :class:`Processed` or raises
:class:`~megatron_media_guard.errors.MediaAlignmentError` saying why not (the caller falls back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..errors import MediaAlignmentError, MediaInputError
from ..repair.reproject import resize_frames
from .layouts import image_to_patches

How = Literal["pinned", "resized", "own-arithmetic"]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Processed:
    """One item re-processed: its pixel rows (the processor's layout), its grid row, its
    feature count, how it was pinned and with which knobs."""

    rows: torch.Tensor
    grid: tuple[int, ...]
    tokens: int
    how: How
    knobs: tuple[tuple[str, int], ...] = ()


def _budget_knobs(processor: Any) -> tuple[int, int]:
    size = processor.size
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    lo, hi = get("shortest_edge"), get("longest_edge")
    if lo is None or hi is None:
        raise MediaInputError(
            f"{type(processor).__name__}.size has no shortest_edge / longest_edge (the pixel "
            "budget of a patch-merge processor): pass the family's image processor"
        )
    return int(lo), int(hi)


def _backend_resize(processor: Any, original: Any, hw: tuple[int, int]) -> Any:
    """``original`` as the processor reads it, resized to ``hw`` by its backend's own
    ``resize`` (the one its subclass calls after sizing) with its own resampling."""
    from transformers.image_utils import SizeDict

    base = next(
        (c for c in type(processor).__mro__ if c.__name__ in ("PilBackend", "TorchvisionBackend")),
        None,
    )
    if base is None:
        raise MediaInputError(
            f"{type(processor).__name__} is not a transformers image processor with a PIL or "
            "torchvision backend: it cannot be fed a resized original"
        )
    img = processor.process_image(original, do_convert_rgb=processor.do_convert_rgb)
    size = SizeDict(height=hw[0], width=hw[1])
    return base.resize(processor, img, size, resample=processor.resample)


@dataclass(frozen=True)
class PatchMergePin:
    """A patch-merge image processor (``image_grid_thw`` rows ``(1, h, w)``, tokens
    ``t*h*w/merge**2``) pinned to a solved size."""

    grid_input: str = "image_grid_thw"

    def candidates(self, processor: Any, budget: int | None) -> list[dict[str, int]]:
        """Budget knobs that can make the processor's own sizing land on the solved size: the
        solution's budget as ``max_pixels`` (the engine shrank the image), then as
        ``min_pixels`` (it grew it); none without a budget (not an engine replay)."""
        if budget is None:
            return []
        lo, hi = _budget_knobs(processor)
        out = []
        if budget >= lo:
            out.append({"shortest_edge": lo, "longest_edge": budget})
        if budget <= hi:
            out.append({"shortest_edge": budget, "longest_edge": hi})
        return out

    def run(self, processor: Any, original: Any, solution: Any) -> Processed:
        if processor is None:
            raise MediaAlignmentError("no processor given to re-process the original with")
        merge = int(getattr(processor, "merge_size", 2))
        patch = int(getattr(processor, "patch_size", 14))
        want = (solution.size_hw[0] // patch, solution.size_hw[1] // patch)
        for knobs in self.candidates(processor, solution.budget):
            out = processor(images=[original], size=dict(knobs), return_tensors="pt")
            grid = tuple(int(v) for v in out[self.grid_input][0].tolist())
            if grid[1:] == want:
                return self._done(out, grid, merge, "pinned", knobs)
        resized = _backend_resize(processor, original, solution.size_hw)
        out = processor(
            images=[resized],
            do_resize=False,
            do_convert_rgb=False,
            input_data_format="channels_first",
            return_tensors="pt",
        )
        grid = tuple(int(v) for v in out[self.grid_input][0].tolist())
        return self._done(out, grid, merge, "resized", {})

    def _done(self, out, grid, merge: int, how: How, knobs: dict) -> Processed:
        tokens = int(np.prod(grid)) // (merge * merge)
        rows = out["pixel_values"]
        return Processed(rows, grid, tokens, how, tuple(sorted(knobs.items())))


def as_channels_first(original: Any) -> torch.Tensor:
    """An original image as the torchvision-backed processors read it: ``[C, H, W]`` (RGB for
    a PIL image, its own channels for an array / tensor, ``HWC`` or ``CHW``), its dtype kept."""
    from PIL import Image

    if isinstance(original, Image.Image):
        from transformers.image_transforms import convert_to_rgb

        return torch.from_numpy(np.asarray(convert_to_rgb(original, return_numpy=True))).permute(
            2, 0, 1
        )
    t = (
        torch.as_tensor(np.asarray(original))
        if not isinstance(original, torch.Tensor)
        else original
    )
    if t.ndim == 2:
        return t[None]
    if t.ndim != 3:
        raise MediaInputError(
            f"an original image must be a PIL image or an array [H, W, C] / [C, H, W], got "
            f"shape {tuple(t.shape)}"
        )
    return t if t.shape[0] in (1, 3, 4) and t.shape[-1] not in (1, 3, 4) else t.permute(2, 0, 1)


@dataclass(frozen=True)
class RadioPin:
    """Nemotron Omni's image processor at a solved RADIO patch grid (own arithmetic; see the
    module docstring): ``image_grid_hw`` rows ``(gh, gw)``, ``gh*gw/4`` tokens."""

    patch: int = 16
    merge: int = 2

    def run(self, processor: Any, original: Any, solution: Any) -> Processed:
        gh, gw = solution.grid
        patch = int(getattr(processor, "patch_size", self.patch))
        mean = getattr(processor, "image_mean", CLIP_MEAN)
        std = getattr(processor, "image_std", CLIP_STD)
        rescale = float(getattr(processor, "rescale_factor", 1 / 255))
        img = as_channels_first(original)
        if img.shape[0] == 1:
            img = img.expand(3, -1, -1)
        frames = img[None, :3].to(torch.float32)
        frames = resize_frames(frames, (gh * patch, gw * patch))
        # the processor's fused rescale and normalize: (x - mean/r) / (std/r), r = rescale
        m = torch.tensor(mean) * (1.0 / rescale)
        s = torch.tensor(std) * (1.0 / rescale)
        x = frames[0].sub(m.view(-1, 1, 1)).div_(s.view(-1, 1, 1))
        rows = image_to_patches(x, patch)
        return Processed(rows, (gh, gw), gh * gw // (self.merge * self.merge), "own-arithmetic")


#: per family, how its images are re-processed from the original (absent: never; the
#: collate check's repair then falls back, saying so)
PINS: dict[str, PatchMergePin | RadioPin] = {
    "qwen_vl": PatchMergePin(),
    "glm4v": PatchMergePin(),
    "ernie4_5_vl": PatchMergePin(),
    "nemotron_omni": RadioPin(),
}

__all__ = ["PINS", "PatchMergePin", "Processed", "RadioPin", "as_channels_first"]
