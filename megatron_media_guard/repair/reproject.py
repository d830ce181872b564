"""On-device re-projection of one mismatched item to a target feature count (``reencode``,
for each item a plan marks ``repair(target)``): its pixels recovered as frames, resized to
the geometry solution's size on their own device, put back into the encoder's layout and
encoded by the user's encoder. The checks here raise ``MediaAlignmentError``
(``MediaInputError`` for bad input); what the encoder raises propagates (the merge records
it and falls back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from megatron_media_guard.errors import MediaAlignmentError, MediaInputError
from megatron_media_guard.geometry import Solution
from megatron_media_guard.geometry.solution import check_hw
from megatron_media_guard.repair.fp8 import pad_for_fp8, padded_multiple
from megatron_media_guard.repair.pixels import (
    QWEN_MERGE,
    QWEN_PATCH,
    QWEN_TEMPORAL_PATCH,
    Layout,
    check_layout,
    from_frames,
    to_frames,
)

Encoder = Callable[..., torch.Tensor]  # encoder(pixels, **kwargs) -> features [n, h]


@dataclass(frozen=True, eq=False)
class ReencodeResult:
    """One re-projected item: ``features [tokens, h]`` (in the encoder's autograd graph),
    the pixel ``size_hw`` resized to, the patch ``grid`` before merge (qwen_patches: the new
    ``grid_thw``'s; else the solution's), qwen_patches' new ``grid_thw``, the frames encoded
    (temporal repeats included) and the FP8 padding rows trimmed off."""

    features: torch.Tensor
    tokens: int
    size_hw: tuple[int, int]
    grid: tuple[int, int] | None
    grid_thw: tuple[int, int, int] | None
    num_frames: int
    fp8_pad: int


def resize_frames(frames: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Frames ``[T, C, H, W]`` resized to ``[T, C, *size_hw]`` on their own device (``frames``
    itself at that size): bicubic, antialias, in float32, back in the input dtype (integers
    rounded and clamped). Resizing normalized pixels equals normalizing resized ones:
    resampling is linear with weights summing to 1, so it commutes with ``(x - mean) / std``
    (only bicubic overshoot at hard edges is not clipped to [0, 255])."""
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise MediaInputError(f"resize_frames takes frames [T, C, H, W], got {shape}")
    height, width = check_hw(size_hw)
    if frames.shape[-2:] == (height, width):
        return frames
    out = F.interpolate(
        frames.float(), (height, width), mode="bicubic", antialias=True, align_corners=False
    )
    if frames.dtype.is_floating_point:
        return out.to(frames.dtype)
    info = torch.iinfo(frames.dtype)
    return out.round_().clamp_(info.min, info.max).to(frames.dtype)


def resize_patches(
    pixels: torch.Tensor,
    grid_thw: object,
    size_hw: tuple[int, int],
    *,
    patch: int = QWEN_PATCH,
    temporal_patch: int = QWEN_TEMPORAL_PATCH,
    merge: int = QWEN_MERGE,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One item's ``qwen_patches`` resized on their own device to ``size_hw`` pixels a frame:
    the new patches ``[t*h*w, C*tp*p*p]`` and their ``(t, h, w)`` (from shapes: no transfer).
    A repair without the encode: the Qwen-VL adapter feeds them to the model's own tower."""
    qwen = {"patch": patch, "temporal_patch": temporal_patch, "merge": merge}
    height, width = check_hw(size_hw)
    frames = to_frames(pixels, "qwen_patches", grid_thw=grid_thw, **qwen)
    # an image is tp copies of itself: when every group holds one repeated frame (one
    # comparison, a host sync on an accelerator), only the first of each is resized
    groups = rearrange(frames, "(t tp) c h w -> t tp c h w", tp=temporal_patch)
    rest, first = groups[:, 1:], groups[:, :1]
    if (
        temporal_patch > 1
        and frames.shape[-2:] != (height, width)
        and rest.equal(first.expand_as(rest))
    ):
        firsts = resize_frames(groups[:, 0], (height, width))
        resized = repeat(firsts, "t c h w -> (t tp) c h w", tp=temporal_patch)
    else:
        resized = resize_frames(frames, (height, width))
    patches, _ = from_frames(resized, "qwen_patches", **qwen)
    t = -(-resized.shape[0] // temporal_patch)
    return patches, (t, height // patch, width // patch)


def _target_size(solution: Solution, layout: Layout, patch: int) -> tuple[int, int]:
    if getattr(solution, "reachable", True) is False:
        raise MediaAlignmentError(
            f"repair target of {solution.tokens} tokens is unreachable: "
            f"{getattr(solution, 'reason', None) or 'no reason given'}",
            context={"tokens": solution.tokens, "reason": getattr(solution, "reason", None)},
        )
    size_hw = getattr(solution, "size_hw", None)
    if size_hw is not None:
        return check_hw(size_hw)
    grid = getattr(solution, "grid", None)
    if layout == "qwen_patches" and grid is not None:
        rows, cols = check_hw(grid)
        return rows * patch, cols * patch
    raise MediaAlignmentError(
        f"repair target of {solution.tokens} tokens has no pixel size (size_hw is None)",
        context={"tokens": solution.tokens},
    )


def reencode(
    pixels: torch.Tensor,
    layout: Layout,
    solution: Solution,
    encoder: Encoder,
    *,
    grid_thw: object = None,
    patch: int = QWEN_PATCH,
    temporal_patch: int = QWEN_TEMPORAL_PATCH,
    merge: int = QWEN_MERGE,
    fp8_multiple: int | None = None,
) -> ReencodeResult:
    """Re-encode one item's ``pixels`` (in ``layout``, as the encoder was fed them) at
    ``solution``'s ``size_hw`` (qwen_patches: else its ``grid``): features ``[tokens, h]``.
    The encoder takes qwen_patches with ``grid_thw=`` (``[1, 3]`` long, the pixels' device),
    their rows padded to ``fp8_multiple`` (whole merge groups; the output trimmed).
    MediaAlignmentError when the new grid or the encoder gives another count (both named)."""
    layout = check_layout(layout)
    tokens = int(solution.tokens)
    size_hw = _target_size(solution, layout, patch)
    new_grid_thw: tuple[int, int, int] | None = None
    fp8_pad = 0
    if layout == "image":
        resized = resize_frames(to_frames(pixels, layout), size_hw)
        new_pixels, encoder_kwargs = from_frames(resized, layout, video=pixels.ndim == 4)
        num_frames = int(resized.shape[0])
        grid = None if getattr(solution, "grid", None) is None else check_hw(solution.grid)
    else:
        qwen = {"patch": patch, "temporal_patch": temporal_patch, "merge": merge}
        new_pixels, new_grid_thw = resize_patches(pixels, grid_thw, size_hw, **qwen)
        thw = torch.tensor([new_grid_thw], dtype=torch.long, device=new_pixels.device)
        encoder_kwargs = {"grid_thw": thw}
        t, h, w = new_grid_thw
        num_frames, grid = t * temporal_patch, (h, w)
        grid_tokens = t * (h // merge) * (w // merge)
        if grid_tokens != tokens:
            raise MediaAlignmentError(
                f"repair target of {tokens} tokens does not match the resized grid_thw "
                f"{new_grid_thw} (merge {merge}), which gives {grid_tokens} tokens",
                context={"expected": tokens, "got": grid_tokens, "grid_thw": list(new_grid_thw)},
            )
        if fp8_multiple is not None:
            multiple = padded_multiple(fp8_multiple, merge * merge)
            new_pixels, fp8_pad = pad_for_fp8(new_pixels, multiple)

    features = encoder(new_pixels, **encoder_kwargs)
    if not isinstance(features, torch.Tensor) or features.ndim != 2:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else None
        raise MediaAlignmentError(
            f"encoder must return features [n, h], got {type(features).__name__} {shape}",
            context={"expected": tokens},
        )
    got = features.shape[0]
    # FP8 padding rows yield at most one feature each, after the real ones: trimmed off
    if not tokens <= got <= tokens + fp8_pad:
        pad = f" (with {fp8_pad} FP8 padding rows, expected {tokens} to {tokens + fp8_pad})"
        raise MediaAlignmentError(
            f"re-encoded item gave {got} features for {tokens} placeholder tokens"
            + (pad if fp8_pad else ""),
            context={"expected": tokens, "got": got, "fp8_pad": fp8_pad},
        )
    features = features[:tokens] if got > tokens else features
    return ReencodeResult(features, tokens, size_hw, grid, new_grid_thw, num_frames, fp8_pad)
