"""Pixel layouts: plain frames ``[T, C, H, W]`` from what the vision tower is fed, and back.

- ``"image"``: an image ``[C, H, W]`` or a video ``[T, C, H, W]``; the encoder takes it alone.
- ``"qwen_patches"``: the Qwen-VL processors' patch rows ``[t*h*w, C*tp*p*p]`` with
  ``grid_thw = (t, h, w)`` in patches before the merge, rows ordered ``(t, h/merge,
  w/merge, merge_h, merge_w)`` (each merge group contiguous), each a patch flattened as
  ``(C, tp, p, p)``. An image is repeated ``tp`` times, a video's frames padded to a
  multiple of ``tp`` with its last. The encoder takes ``grid_thw=`` as a ``[1, 3]`` long
  tensor on the patches' device.

``to_frames`` and ``from_frames`` are exact inverses (pure reshapes: bit-exact).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from einops import rearrange

from megatron_media_guard.errors import MediaInputError

Layout = Literal["image", "qwen_patches"]
LAYOUTS: tuple[str, ...] = get_args(Layout)

# Qwen2-VL's (Qwen3-VL: patch 16)
QWEN_PATCH = 14
QWEN_TEMPORAL_PATCH = 2
QWEN_MERGE = 2

_QWEN_ROWS = "(t hb wb mh mw) (c tp ph pw)"
_QWEN_FRAMES = "(t tp) c (hb mh ph) (wb mw pw)"


def check_layout(layout: str) -> Layout:
    if layout not in LAYOUTS:
        raise MediaInputError(
            f"unknown pixel layout {layout!r}; known layouts: {', '.join(LAYOUTS)}",
            context={"layout": str(layout)},
        )
    return layout  # type: ignore[return-value]


def grid_thw_tuple(grid_thw: object) -> tuple[int, int, int]:
    """``grid_thw`` given as ``(t, h, w)``, a list, or a host tensor ``[3]`` / ``[1, 3]`` as
    three ints. A tensor on an accelerator is refused: reading it is a device-to-host
    transfer, the caller's to make (``core/host.to_host``, saying why)."""
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.device.type != "cpu":
            raise MediaInputError(
                f"grid_thw must be on the host, got a tensor on {grid_thw.device} (read it "
                "back once where the call knows why, then pass the ints)",
                context={"device": str(grid_thw.device)},
            )
        grid_thw = grid_thw.reshape(-1).tolist()  # host memory: no transfer
    try:
        values = [int(v) for v in grid_thw]  # type: ignore[union-attr]
    except TypeError as exc:
        raise MediaInputError(f"grid_thw must be (t, h, w), got {grid_thw!r}") from exc
    if len(values) != 3 or min(values) < 1:
        raise MediaInputError(
            f"grid_thw must be three positive ints (t, h, w), got {values}",
            context={"grid_thw": values},
        )
    return values[0], values[1], values[2]


def _qwen_dims(patch: int, temporal_patch: int, merge: int) -> dict[str, int]:
    """The qwen_patches layout's einops sizes, checked."""
    sizes = {"patch": patch, "temporal_patch": temporal_patch, "merge": merge}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise MediaInputError(f"qwen_patches sizes must be positive ints, got {bad}", context=bad)
    return {"tp": temporal_patch, "mh": merge, "mw": merge, "ph": patch, "pw": patch}


def to_frames(
    pixels: torch.Tensor,
    layout: Layout,
    *,
    grid_thw: object = None,
    patch: int = QWEN_PATCH,
    temporal_patch: int = QWEN_TEMPORAL_PATCH,
    merge: int = QWEN_MERGE,
) -> torch.Tensor:
    """Frames ``[T, C, H, W]`` held by ``pixels`` in ``layout`` (a view where possible):
    ``"image"`` ``[C, H, W]`` as ``[1, C, H, W]``; ``"qwen_patches"`` with ``grid_thw=(t, h,
    w)`` as ``[t*tp, C, h*p, w*p]`` (an image comes back as its ``tp`` repeated frames)."""
    layout = check_layout(layout)
    if not isinstance(pixels, torch.Tensor):
        raise MediaInputError(f"pixels must be a torch.Tensor, got {type(pixels).__name__}")
    if layout == "image":
        if pixels.ndim == 3:
            return pixels.unsqueeze(0)
        if pixels.ndim == 4:
            return pixels
        raise MediaInputError(
            f"layout 'image' takes [C, H, W] or [T, C, H, W], got shape {tuple(pixels.shape)}",
            context={"shape": list(pixels.shape)},
        )

    dims = _qwen_dims(patch, temporal_patch, merge)
    if grid_thw is None:
        raise MediaInputError("layout 'qwen_patches' needs grid_thw=(t, h, w)")
    t, h, w = grid_thw_tuple(grid_thw)
    if h % merge or w % merge:
        raise MediaInputError(
            f"grid_thw {(t, h, w)} is not divisible by merge size {merge}",
            context={"grid_thw": [t, h, w], "merge": merge},
        )
    row_len = temporal_patch * patch * patch
    if pixels.ndim != 2 or pixels.shape[0] != t * h * w or pixels.shape[1] % row_len:
        raise MediaInputError(
            f"layout 'qwen_patches' with grid_thw {(t, h, w)}, patch {patch}, temporal_patch "
            f"{temporal_patch} expects [{t * h * w}, C*{row_len}], got shape {tuple(pixels.shape)}",
            context={"shape": list(pixels.shape), "grid_thw": [t, h, w]},
        )
    return rearrange(pixels, f"{_QWEN_ROWS} -> {_QWEN_FRAMES}", t=t, hb=h // merge, **dims)


def from_frames(
    frames: torch.Tensor,
    layout: Layout,
    *,
    video: bool | None = None,
    patch: int = QWEN_PATCH,
    temporal_patch: int = QWEN_TEMPORAL_PATCH,
    merge: int = QWEN_MERGE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Frames ``[T, C, H, W]`` put into ``layout``: ``(pixels, the encoder's keyword
    arguments)``. ``"image"``: ``[C, H, W]`` for ``video=False`` (T == 1), ``[T, C, H, W]``
    for ``video=True`` (None: squeezed only when T == 1), ``{}``. ``"qwen_patches"``: H and
    W multiples of ``patch*merge``, T padded to a multiple of ``temporal_patch`` with the
    last frame as the processor does, ``{"grid_thw": LongTensor [1, 3]}``."""
    layout = check_layout(layout)
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4 or frames.shape[0] < 1:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise MediaInputError(f"frames must be a tensor [T, C, H, W] with T >= 1, got {shape}")
    num_frames, _, height, width = frames.shape
    if layout == "image":
        if video is False and num_frames != 1:
            raise MediaInputError(
                f"an image ([C, H, W]) needs exactly 1 frame, got {num_frames}",
                context={"num_frames": num_frames},
            )
        squeeze = (video is False) or (video is None and num_frames == 1)
        return (frames[0] if squeeze else frames), {}

    dims = _qwen_dims(patch, temporal_patch, merge)
    factor = patch * merge
    if height % factor or width % factor:
        raise MediaInputError(
            f"frame size {(height, width)} is not a multiple of patch*merge = {factor}",
            context={"frame_hw": [height, width], "factor": factor},
        )
    if pad := -num_frames % temporal_patch:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
    grid = (frames.shape[0] // temporal_patch, height // patch, width // patch)
    patches = rearrange(frames, f"{_QWEN_FRAMES} -> {_QWEN_ROWS}", **dims)
    return patches, {"grid_thw": torch.tensor([grid], dtype=torch.long, device=frames.device)}
