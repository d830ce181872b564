"""One original processed at a solved size as the family's processor does (:mod:`.reprocess`):
:class:`PatchMergePin` drives the family's own image processor; :class:`RadioPin` and
:class:`PatchMergeVideoPin` reproduce torchvision-backed processors with the library's own
arithmetic. ``run`` returns a :class:`Processed` or raises ``MediaAlignmentError`` (fallback).
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """One item re-processed: its pixel rows (the processor's layout), grid row, feature count,
    how it was pinned and with which knobs."""

    rows: torch.Tensor
    grid: tuple[int, ...]
    tokens: int
    how: How
    knobs: tuple[tuple[str, int], ...] = ()


def _backend_resize(processor: Any, original: Any, hw: tuple[int, int]) -> Any:
    """``original`` as the processor reads it, resized to ``hw`` by its backend's own
    ``resize`` and resampling."""
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
    """A patch-merge image processor (Qwen-VL, GLM-4V, Ernie 4.5 VL) pinned to a solved size: its
    own budget knobs (``size={"shortest_edge", "longest_edge"}`` per call) where they land
    there, else the original resized by its backend and processed with ``do_resize=False``."""

    grid_input: str = "image_grid_thw"

    def candidates(self, processor: Any, budget: int | None) -> list[dict[str, int]]:
        """Knobs that can make the processor's sizing land on the solved size: the solution's
        budget as the upper edge (the engine shrank the image), then as the lower (it grew it);
        none without a budget (not an engine replay)."""
        if budget is None:
            return []
        lo, hi = (_setting(processor.size, k, None) for k in ("shortest_edge", "longest_edge"))
        if lo is None or hi is None:
            raise MediaInputError(
                f"{type(processor).__name__}.size has no shortest_edge / longest_edge (the pixel "
                "budget of a patch-merge processor): pass the family's image processor"
            )
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

        def done(out, how: How, knobs: dict) -> Processed:
            grid = tuple(int(v) for v in out[self.grid_input][0].tolist())
            tokens = int(np.prod(grid)) // (merge * merge)
            return Processed(out["pixel_values"], grid, tokens, how, tuple(sorted(knobs.items())))

        for knobs in self.candidates(processor, solution.budget):
            out = processor(images=[original], size=dict(knobs), return_tensors="pt")
            got = done(out, "pinned", knobs)
            if got.grid[1:] == want:
                return got
        resized = _backend_resize(processor, original, solution.size_hw)
        out = processor(
            images=[resized],
            do_resize=False,
            do_convert_rgb=False,
            input_data_format="channels_first",
            return_tensors="pt",
        )
        return done(out, "resized", {})


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def as_channels_first(original: Any) -> torch.Tensor:
    """An original image as torchvision-backed processors read it: ``[C, H, W]`` (RGB from PIL;
    an array's own channels, ``HWC`` or ``CHW``), its dtype kept."""
    from PIL import Image

    if isinstance(original, Image.Image):
        from transformers.image_transforms import convert_to_rgb

        rgb = np.asarray(convert_to_rgb(original, return_numpy=True))
        return torch.from_numpy(rgb).permute(2, 0, 1)
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
    """Nemotron Omni's image processor at a solved RADIO patch grid (``gh*gw/4`` tokens): RGB
    float32, its float resize, its fused rescale-and-normalize, row-major patches; a processor
    given lends its ``image_mean`` / ``image_std`` / ``rescale_factor`` / ``patch_size``."""

    patch: int = 16
    merge: int = 2

    def run(self, processor: Any, original: Any, solution: Any) -> Processed:
        gh, gw = solution.grid
        patch = int(_setting(processor, "patch_size", self.patch))
        frames = as_frames([original]).to(torch.float32)  # one RGB frame [1, 3, H, W]
        x = _normalized(processor, resize_frames(frames, (gh * patch, gw * patch)))
        rows = image_to_patches(x[0], patch)
        return Processed(rows, (gh, gw), gh * gw // (self.merge * self.merge), "own-arithmetic")


def tensor_resize(frames: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Frames ``[T, C, H, W]`` resized as torchvision's bicubic antialiased tensor ``resize``
    (the video processors'): uint8 on CPU by torch's uint8 kernel (it rounds differently from
    the float path), else :func:`~..repair.reproject.resize_frames`."""
    if tuple(frames.shape[-2:]) == tuple(size_hw):
        return frames
    if frames.dtype == torch.uint8 and frames.device.type == "cpu":
        return F.interpolate(
            frames, size=tuple(size_hw), mode="bicubic", antialias=True, align_corners=False
        )
    return resize_frames(frames, size_hw)


def as_frames(original: Any) -> torch.Tensor:
    """A video's original as the video processors read it: ``[T, C, H, W]`` (RGB, dtype kept)
    from a list of frames or an array ``[T, H, W, C]`` / ``[T, C, H, W]``."""
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
    """Frames ``[T, C, H, W]`` as transformers' torchvision backend rescales and normalizes
    them with the processor's settings (a config dict's; CLIP's defaults): float32, fused as
    ``(x - mean/r) / (std/r)`` with ``r`` the rescale factor when both are on."""
    x = frames.to(torch.float32)
    rescale = float(_setting(processor, "rescale_factor", 1 / 255))
    do_rescale = bool(_setting(processor, "do_rescale", True))
    if not _setting(processor, "do_normalize", True):
        return x * rescale if do_rescale else x
    r = 1.0 / rescale if do_rescale else 1.0
    m = torch.tensor(_setting(processor, "image_mean", CLIP_MEAN)) * r
    s = torch.tensor(_setting(processor, "image_std", CLIP_STD)) * r
    return x.sub(m.view(-1, 1, 1)).div_(s.view(-1, 1, 1))


@dataclass(frozen=True)
class PatchMergeVideoPin:
    """A patch-merge video processor at a solved frame size, in the library's arithmetic:
    ``h*w/merge**2`` tokens per temporal group (the last frame repeated to whole groups).
    row_frames: frames in one patch row (None: the temporal patch; 1: Ernie, whose ``t``
    counts frames). draws: its processor can draw timestamps on the frames
    (``draw_on_frames``): refused when on, the font rendering is not reproduced."""

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
        for key in ("patch", "merge", "temporal_patch"):
            name = f"{key}_size"
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


#: per (family, modality), how its media are re-processed from the original; a string: why
#: never (absent: no pin; the collate check's repair then falls back, saying so)
PINS: dict[tuple[str, str], PatchMergePin | RadioPin | PatchMergeVideoPin | str] = {
    ("qwen_vl", "image"): PatchMergePin(),
    ("glm4v", "image"): PatchMergePin(),
    ("ernie4_5_vl", "image"): PatchMergePin(),
    ("nemotron_omni", "image"): RadioPin(),
    ("qwen_vl", "video"): PatchMergeVideoPin(),
    ("glm4v", "video"): PatchMergeVideoPin(),
    ("ernie4_5_vl", "video"): PatchMergeVideoPin(row_frames=1, draws=True),
    ("nemotron_omni", "video"): (
        "frames sized by the fixed video_target_num_patches, not a pixel budget"
    ),
}
