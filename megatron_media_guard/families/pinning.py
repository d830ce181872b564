"""How one original is processed at a solved size, the way each family's processor does it
(the data side's repair, :mod:`.reprocess`): :class:`PatchMergePin` drives the family's own
image processor; :class:`RadioPin` and :class:`PatchMergeVideoPin` reproduce processors that
import torchvision (no CPU build here) with the library's own arithmetic. Each
``run(processor, original, solution)`` returns a :class:`Processed` or raises
:class:`~megatron_media_guard.errors.MediaAlignmentError` saying why not (the caller falls back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import MediaAlignmentError, MediaInputError
from ..repair.pixels import from_frames
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
    lo, hi = (_setting(processor.size, k, None) for k in ("shortest_edge", "longest_edge"))
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
    """A patch-merge image processor (Qwen-VL, GLM-4V, Ernie 4.5 VL; ``image_grid_thw`` rows
    ``(1, h, w)``, tokens ``t*h*w/merge**2``) pinned to a solved size: its own budget knobs
    (``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``, per call) where they
    land there, else the original resized by the processor's own backend ``resize`` and then
    processed with ``do_resize=False``."""

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


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def as_channels_first(original: Any) -> torch.Tensor:
    """An original image as the torchvision-backed processors read it: ``[C, H, W]`` (RGB for
    a PIL image, its own channels for an array / tensor, ``HWC`` or ``CHW``), its dtype kept."""
    from PIL import Image

    if isinstance(original, Image.Image):
        from transformers.image_transforms import convert_to_rgb

        return torch.from_numpy(np.asarray(convert_to_rgb(original, return_numpy=True))).permute(
            2, 0, 1
        )
    t = _tensor(original)
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
    """Nemotron Omni's image processor at a solved RADIO patch grid (``image_grid_hw`` rows
    ``(gh, gw)``, ``gh*gw/4`` tokens): the image read as RGB channels first, float32, resized
    by :func:`~..repair.reproject.resize_frames` (the processor's float resize), its fused
    rescale-and-normalize, row-major patches; a processor passed in lends its ``image_mean`` /
    ``image_std`` / ``rescale_factor`` / ``patch_size``."""

    patch: int = 16
    merge: int = 2

    def run(self, processor: Any, original: Any, solution: Any) -> Processed:
        gh, gw = solution.grid
        patch = int(_setting(processor, "patch_size", self.patch))
        img = as_channels_first(original)
        frames = img.expand(3, -1, -1) if img.shape[0] == 1 else img
        frames = resize_frames(frames[None, :3].to(torch.float32), (gh * patch, gw * patch))
        x = _normalized(processor, frames)
        rows = image_to_patches(x[0], patch)
        return Processed(rows, (gh, gw), gh * gw // (self.merge * self.merge), "own-arithmetic")


def rescale_normalize(
    frames: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    rescale: float,
    do_rescale: bool = True,
    do_normalize: bool = True,
) -> torch.Tensor:
    """Frames ``[T, C, H, W]`` as transformers' torchvision backend rescales and normalizes
    them (``rescale_and_normalize``): float32, fused as ``(x - mean/r) / (std/r)`` with
    ``r = rescale`` when both are on; else ``x * r``, or ``(x - mean) / std``."""
    x = frames.to(torch.float32)
    if do_normalize:
        r = 1.0 / rescale if do_rescale else 1.0
        m = torch.tensor(mean) * r if do_rescale else torch.tensor(mean)
        s = torch.tensor(std) * r if do_rescale else torch.tensor(std)
        return x.sub(m.view(-1, 1, 1)).div_(s.view(-1, 1, 1))
    return x * rescale if do_rescale else x


def tensor_resize(frames: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Frames ``[T, C, H, W]`` resized as torchvision's tensor ``resize`` does with bicubic
    and antialias (what the transformers video processors call): the frames themselves at
    their own size; uint8 on CPU natively (torch's uint8 antialiased bicubic kernel, which
    rounds differently from the float path); else :func:`~..repair.reproject.resize_frames`
    (float, then rounded and clamped for an integer dtype: torchvision's path elsewhere)."""
    if tuple(frames.shape[-2:]) == tuple(size_hw):
        return frames
    if frames.dtype == torch.uint8 and frames.device.type == "cpu":
        return F.interpolate(
            frames, size=tuple(size_hw), mode="bicubic", antialias=True, align_corners=False
        )
    return resize_frames(frames, size_hw)


def as_frames(original: Any) -> torch.Tensor:
    """A video's original as the video processors read it: ``[T, C, H, W]`` (RGB, its dtype
    kept) from a list of frames (PIL images, arrays ``HWC`` / ``CHW``) or an array / tensor
    ``[T, H, W, C]`` / ``[T, C, H, W]``."""
    if isinstance(original, (list, tuple)):
        frames = [as_channels_first(f) for f in original]
    else:
        t = _tensor(original)
        if t.ndim != 4:
            raise MediaInputError(
                "a video's original must be its frames: a list of PIL images / arrays, or an "
                f"array [T, H, W, C] / [T, C, H, W], got shape {tuple(t.shape)}"
            )
        frames = [as_channels_first(f) for f in t]
    if not frames or len({tuple(f.shape) for f in frames}) != 1:
        sizes = sorted({tuple(f.shape) for f in frames})
        raise MediaInputError(
            f"a video's original must hold at least one frame, all of one size; got {sizes}"
        )
    x = torch.stack(frames)
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x[:, :3]


def _setting(processor: Any, name: str, default: Any) -> Any:
    v = processor.get(name) if isinstance(processor, Mapping) else getattr(processor, name, None)
    return default if v is None else v


def _normalized(processor: Any, frames: torch.Tensor) -> torch.Tensor:
    """``rescale_normalize`` with the processor's settings (or a config dict's; CLIP's
    defaults where it has none)."""
    return rescale_normalize(
        frames,
        _setting(processor, "image_mean", CLIP_MEAN),
        _setting(processor, "image_std", CLIP_STD),
        float(_setting(processor, "rescale_factor", 1 / 255)),
        bool(_setting(processor, "do_rescale", True)),
        bool(_setting(processor, "do_normalize", True)),
    )


@dataclass(frozen=True)
class PatchMergeVideoPin:
    """A patch-merge video processor (``video_grid_thw`` rows ``(t, h, w)``) at a solved frame
    size: the library's own implementation (module docstring). Tokens: ``h*w/merge**2`` per
    temporal group of ``temporal_patch`` frames (the clip padded to whole groups by repeating
    its last frame).

    row_frames: frames in one patch row, the processor's ``patchify``: None, the temporal patch
    (Qwen-VL, GLM-4V: ``t`` counts groups); 1 (Ernie 4.5 VL: one frame a row, ``t`` counts
    frames, its resampler merges the pairs). draws: the family's video processor can draw each
    frame's timestamp on it (``draw_on_frames``, Ernie's default): refused when on, the font
    rendering is not reproduced.
    """

    grid_input: str = "video_grid_thw"
    row_frames: int | None = None
    draws: bool = False

    def run(self, processor: Any, original: Any, solution: Any, sizes: Mapping) -> Processed:
        """``sizes``: the model's ``patch`` / ``merge`` / ``temporal_patch``."""
        if processor is None:
            raise MediaAlignmentError(
                "no video processor given to re-process the frames with: pass processor="
                "{'image': ..., 'video': <the family's video processor, or its "
                "video_preprocessor_config as a dict>}"
            )
        if self.draws and _setting(processor, "draw_on_frames", True):
            raise MediaAlignmentError(
                "the video processor draws each frame's timestamp on it (draw_on_frames, its "
                "default) with its font, which is not reproduced here: re-processed only with "
                "draw_on_frames=False"
            )
        for key, name in (
            ("patch", "patch_size"),
            ("merge", "merge_size"),
            ("temporal_patch", "temporal_patch_size"),
        ):
            got = int(_setting(processor, name, sizes[key]))
            if got != sizes[key]:
                raise MediaAlignmentError(
                    f"the video processor's {name} is {got}, the model's {sizes[key]}: "
                    "pass the model's own video processor"
                )
        resample = _setting(processor, "resample", 3)
        if int(getattr(resample, "value", resample)) != 3:  # PIL / torchvision bicubic
            raise MediaAlignmentError(
                f"the video processor resamples with {resample!r}; only its bicubic resize "
                "is reproduced here"
            )
        p, m, tp = sizes["patch"], sizes["merge"], sizes["temporal_patch"]
        frames = as_frames(original)
        if pad := -frames.shape[0] % tp:  # whole temporal groups: the last frame repeated
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        x = _normalized(processor, tensor_resize(frames, solution.size_hw))
        rf = self.row_frames or tp
        rows, _ = from_frames(x, "qwen_patches", patch=p, temporal_patch=rf, merge=m)
        grid = (x.shape[0] // rf, x.shape[-2] // p, x.shape[-1] // p)
        tokens = x.shape[0] // tp * (grid[1] * grid[2] // (m * m))
        return Processed(rows, grid, tokens, "own-arithmetic")


#: per family, how its images are re-processed from the original (absent: never; the
#: collate check's repair then falls back, saying so)
PINS: dict[str, PatchMergePin | RadioPin] = {
    "qwen_vl": PatchMergePin(),
    "glm4v": PatchMergePin(),
    "ernie4_5_vl": PatchMergePin(),
    "nemotron_omni": RadioPin(),
}

#: per family, how its videos are re-processed from their frames
VIDEO_PINS: dict[str, PatchMergeVideoPin] = {
    "qwen_vl": PatchMergeVideoPin(),
    "glm4v": PatchMergeVideoPin(),
    "ernie4_5_vl": PatchMergeVideoPin(row_frames=1, draws=True),
}

#: why a family's videos are never re-processed (a family in neither: no pin for it)
NO_VIDEO_PIN: dict[str, str] = {
    "nemotron_omni": ("frames sized by the fixed video_target_num_patches, not a pixel budget"),
}

__all__ = [
    "NO_VIDEO_PIN",
    "PINS",
    "VIDEO_PINS",
    "PatchMergePin",
    "PatchMergeVideoPin",
    "Processed",
    "RadioPin",
    "as_channels_first",
    "as_frames",
    "rescale_normalize",
    "tensor_resize",
]
