"""On-device re-projection of one mismatched media item to a target feature count.

The merge calls ``reencode`` for each item its plan marks ``repair(target)``, and
only for those: the pixels it was given are recovered as frames, resized to the
geometry solution's pixel size on their own device, put back into the layout the
vision encoder takes, and encoded by the user's encoder (vision tower + projector).

Errors: the checks made here raise ``MediaAlignmentError`` (``MediaInputError``
for bad input). Anything the encoder raises (out of memory, shape errors) is not
caught: the merge catches it, records its type and message, and falls back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from megatron_media_guard.errors import MediaAlignmentError, MediaInputError
from megatron_media_guard.geometry import Solution
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

Encoder = Callable[..., torch.Tensor]
"""``encoder(pixels, **encoder_kwargs) -> features [n, h]`` (``grid_thw=`` for qwen_patches)."""


@dataclass(frozen=True, eq=False)
class ReencodeResult:
    """One re-projected item.

    features: ``[tokens, h]``, in the autograd graph of the encoder's parameters.
    size_hw: pixel (H, W) the frames were resized to.
    grid: patch (rows, cols) before merge; for qwen_patches read from the new
        ``grid_thw``, otherwise the solution's ``grid`` (None when it has none).
    grid_thw: qwen_patches' new (t, h, w); None for other layouts.
    num_frames: frames encoded (for qwen_patches including temporal repeats).
    fp8_pad: zero patch rows appended for FP8 and trimmed off again (0 when none).
    duration_ms: host wall time of recover + resize + patchify + encode; on an
        accelerator it covers kernel launches only unless ``synchronize=True``.
    """

    features: torch.Tensor
    tokens: int
    size_hw: tuple[int, int]
    grid: tuple[int, int] | None
    grid_thw: tuple[int, int, int] | None
    num_frames: int
    fp8_pad: int
    duration_ms: float


def _size_pair(size_hw: object) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in size_hw)  # type: ignore[union-attr]
    except (TypeError, ValueError) as exc:
        raise MediaInputError(f"size_hw must be (H, W), got {size_hw!r}") from exc
    if height < 1 or width < 1:
        raise MediaInputError(
            f"size_hw must be positive, got {(height, width)}",
            context={"size_hw": [height, width]},
        )
    return height, width


def resize_frames(frames: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Frames ``[T, C, H, W]`` resized to ``[T, C, *size_hw]`` on their own device.

    Bicubic with antialias (align_corners=False), computed in float32, returned in
    the input dtype (integer dtypes rounded and clamped to their range). Returns
    ``frames`` itself when the size already matches.

    Resizing normalized pixels is the same as resizing raw ones and normalizing
    after: resampling is a linear map whose kernel weights sum to 1 (antialias
    renormalizes them), so it commutes with the per-channel affine
    ``(x - mean) / std``. The one difference from resizing 8-bit images first is
    that bicubic overshoot at hard edges is not clipped to [0, 255].
    """
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise MediaInputError(f"resize_frames takes frames [T, C, H, W], got {shape}")
    height, width = _size_pair(size_hw)
    if frames.shape[-2:] == (height, width):
        return frames
    out = F.interpolate(
        frames.float(),
        size=(height, width),
        mode="bicubic",
        antialias=True,
        align_corners=False,
    )
    if frames.dtype.is_floating_point:
        return out.to(frames.dtype)
    info = torch.iinfo(frames.dtype)
    return out.round_().clamp_(info.min, info.max).to(frames.dtype)


def _resize_temporal_groups(
    frames: torch.Tensor, size_hw: tuple[int, int], temporal_patch: int
) -> torch.Tensor:
    """``resize_frames``, resizing once a frame the processor repeated over a temporal group.

    The Qwen processors feed an image as ``temporal_patch`` copies of itself; when every
    group holds one repeated frame (one comparison, a host sync on an accelerator), only
    the first of each group is resized: the same values for half the work.
    """
    if temporal_patch == 1 or frames.shape[-2:] == tuple(size_hw):
        return resize_frames(frames, size_hw)
    groups = rearrange(frames, "(t tp) c h w -> t tp c h w", tp=temporal_patch)
    firsts = groups[:, :1]
    if not torch.equal(groups[:, 1:], firsts.expand_as(groups[:, 1:])):
        return resize_frames(frames, size_hw)
    resized = resize_frames(firsts[:, 0], size_hw)
    return repeat(resized, "t c h w -> (t tp) c h w", tp=temporal_patch)


def resize_patches(
    pixels: torch.Tensor,
    grid_thw: object,
    size_hw: tuple[int, int],
    *,
    patch: int = QWEN_PATCH,
    temporal_patch: int = QWEN_TEMPORAL_PATCH,
    merge: int = QWEN_MERGE,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One item's ``qwen_patches`` resized on their own device to ``size_hw`` pixels a frame.

    The patches are unfolded to frames, resized (bicubic, antialias; a frame the processor
    repeated over a temporal group is resized once) and put back in the same patch layout.
    Returns the new patches ``[t*h*w, C*tp*p*p]`` and their ``(t, h, w)`` (read from shapes:
    no transfer). This is a repair without the encode: the Qwen-VL adapter feeds the result
    to the model's own vision tower.
    """
    qwen = {"patch": patch, "temporal_patch": temporal_patch, "merge": merge}
    height, width = _size_pair(size_hw)
    frames = to_frames(pixels, "qwen_patches", grid_thw=grid_thw, **qwen)
    resized = _resize_temporal_groups(frames, (height, width), temporal_patch)
    patches, _ = from_frames(resized, "qwen_patches", **qwen)
    t = -(-resized.shape[0] // temporal_patch)
    return patches, (t, height // patch, width // patch)


def _target_size(solution: Solution, layout: Layout, patch: int) -> tuple[int, int]:
    """Pixel (H, W) to resize to: ``solution.size_hw``, else ``solution.grid * patch`` (qwen)."""
    if getattr(solution, "reachable", True) is False:
        raise MediaAlignmentError(
            f"repair target of {solution.tokens} tokens is unreachable: "
            f"{getattr(solution, 'reason', None) or 'no reason given'}",
            context={"tokens": solution.tokens, "reason": getattr(solution, "reason", None)},
        )
    size_hw = getattr(solution, "size_hw", None)
    if size_hw is not None:
        return _size_pair(size_hw)
    grid = getattr(solution, "grid", None)
    if layout == "qwen_patches" and grid is not None:
        rows, cols = _size_pair(grid)
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
    synchronize: bool = False,
) -> ReencodeResult:
    """Re-encode one item's ``pixels`` at ``solution``'s size; features ``[solution.tokens, h]``.

    pixels: the item as the encoder was fed it (``"image"``: ``[C, H, W]`` /
        ``[T, C, H, W]``; ``"qwen_patches"``: ``[t*h*w, C*tp*p*p]`` with ``grid_thw``).
    solution: target from geometry; ``size_hw`` (or ``grid`` for qwen_patches) and ``tokens``.
    encoder: ``encoder(new_pixels, **encoder_kwargs) -> [n, h]``; for qwen_patches
        ``encoder_kwargs = {"grid_thw": LongTensor [1, 3]}`` on the pixels' device.
    fp8_multiple: for qwen_patches, pad the patch rows to this multiple (kept to
        whole merge groups) before encoding and trim the output (see ``fp8``).
        Ignored for ``"image"``, whose encoder embeds patches itself.

    Raises MediaAlignmentError when the new grid cannot give ``solution.tokens`` or
    the encoder returns another count (both named); encoder exceptions propagate.
    """
    start = time.perf_counter()
    layout = check_layout(layout)
    tokens = int(solution.tokens)
    size_hw = _target_size(solution, layout, patch)
    new_grid_thw: tuple[int, int, int] | None = None
    fp8_pad = 0
    if layout == "image":
        resized = resize_frames(to_frames(pixels, layout), size_hw)
        new_pixels, encoder_kwargs = from_frames(resized, layout, video=pixels.ndim == 4)
        num_frames = resized.shape[0]
        grid = getattr(solution, "grid", None)
        grid = None if grid is None else _size_pair(grid)
    else:
        qwen = {"patch": patch, "temporal_patch": temporal_patch, "merge": merge}
        new_pixels, new_grid_thw = resize_patches(pixels, grid_thw, size_hw, **qwen)
        encoder_kwargs = {
            "grid_thw": torch.tensor([new_grid_thw], dtype=torch.long, device=new_pixels.device)
        }
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
            new_pixels, fp8_pad = pad_for_fp8(
                new_pixels, padded_multiple(fp8_multiple, merge * merge)
            )

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
    if synchronize and features.device.type == "cuda":
        torch.cuda.synchronize(features.device)
    return ReencodeResult(
        features=features,
        tokens=tokens,
        size_hw=size_hw,
        grid=grid,
        grid_thw=new_grid_thw,
        num_frames=int(num_frames),
        fp8_pad=fp8_pad,
        duration_ms=(time.perf_counter() - start) * 1e3,
    )
