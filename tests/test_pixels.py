"""Pixel layouts: exact round trips, and the Qwen2-VL order checked against the real processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard.errors import MediaAlignmentError, MediaGuardError, MediaInputError
from megatron_media_guard.repair.pixels import from_frames, grid_thw_tuple, to_frames

QWEN_SHAPES = st.fixed_dictionaries(
    {k: st.integers(1, 3) for k in ("t", "hb", "wb", "channels", "patch")}
    | {k: st.integers(1, 2) for k in ("temporal_patch", "merge")}
)


def _qwen_kwargs(s: dict) -> dict:
    return {"patch": s["patch"], "temporal_patch": s["temporal_patch"], "merge": s["merge"]}


@settings(max_examples=60, deadline=None)
@given(QWEN_SHAPES, st.integers(0, 2**31 - 1))
def test_qwen_patches_round_trip_is_bit_exact_both_ways(s: dict, seed: int) -> None:
    h, w = s["hb"] * s["merge"], s["wb"] * s["merge"]
    shape = (s["t"] * s["temporal_patch"], s["channels"], h * s["patch"], w * s["patch"])
    dim = s["channels"] * s["temporal_patch"] * s["patch"] ** 2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s["t"] * h * w, dim, generator=g)
    frames = to_frames(x, "qwen_patches", grid_thw=(s["t"], h, w), **_qwen_kwargs(s))
    assert frames.shape == shape
    back, meta = from_frames(frames, "qwen_patches", **_qwen_kwargs(s))
    assert torch.equal(back, x)
    assert meta["grid_thw"].dtype == torch.long
    assert meta["grid_thw"].tolist() == [[s["t"], h, w]]
    # and from frames: patches, then frames again (grid_thw given as the tensor it returned)
    frames = torch.randn(shape, generator=g)
    patches, meta = from_frames(frames, "qwen_patches", **_qwen_kwargs(s))
    back = to_frames(patches, "qwen_patches", grid_thw=meta["grid_thw"], **_qwen_kwargs(s))
    assert torch.equal(back, frames)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9))
def test_image_layout_round_trip(t: int, c: int, h: int, w: int) -> None:
    video = torch.randn(t, c, h, w)
    frames = to_frames(video, "image")
    assert frames.shape == (t, c, h, w)
    back, meta = from_frames(frames, "image", video=True)
    assert meta == {} and torch.equal(back, video)

    image = video[0]
    frames = to_frames(image, "image")
    assert frames.shape == (1, c, h, w)
    back, _ = from_frames(frames, "image", video=False)
    assert back.shape == (c, h, w) and torch.equal(back, image)


@pytest.mark.parametrize(
    ("patch", "merge", "height", "width"), [(14, 2, 56, 84), (16, 2, 64, 96), (14, 1, 42, 28)]
)
def test_recover_matches_the_hf_qwen2_vl_processor(
    patch: int, merge: int, height: int, width: int
) -> None:
    """The processor's pixel_values, recovered, are its normalized image, repeated over time."""
    pytest.importorskip("PIL")
    proc_mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from PIL import Image

    rng = np.random.default_rng(height * width + patch)
    array = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    processor = proc_mod.Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge)
    out = processor(images=[Image.fromarray(array)], do_resize=False, return_tensors="pt")
    pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
    assert grid.tolist() == [[1, height // patch, width // patch]]

    frames = to_frames(pixel_values, "qwen_patches", grid_thw=grid, patch=patch, merge=merge)
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    expected = (torch.from_numpy(array).permute(2, 0, 1).float() / 255 - mean) / std
    assert frames.shape == (2, 3, height, width)
    torch.testing.assert_close(frames[0], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(frames[0], frames[1])  # an image is repeated over temporal_patch

    back, meta = from_frames(frames, "qwen_patches", patch=patch, merge=merge)
    assert torch.equal(back, pixel_values)
    assert torch.equal(meta["grid_thw"], grid)


def _processor_video_patchify(video: np.ndarray, patch: int, tp: int, merge: int) -> np.ndarray:
    """The HF Qwen2-VL video processor's patchify (view + permute), restated with numpy."""
    if pad := -video.shape[0] % tp:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    frames, c, h, w = video.shape
    gt, gh, gw = frames // tp, h // patch, w // patch
    x = video.reshape(gt, tp, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * patch * patch)


@pytest.mark.parametrize("num_frames", [1, 3, 4])
def test_video_patch_order_matches_the_processor_order(num_frames: int) -> None:
    video = np.random.default_rng(num_frames).standard_normal((num_frames, 3, 8, 12))
    video = video.astype(np.float32)
    expected = _processor_video_patchify(video, patch=2, tp=2, merge=2)
    patches, meta = from_frames(torch.from_numpy(video), "qwen_patches", patch=2, merge=2)
    assert torch.equal(patches, torch.from_numpy(expected))
    assert meta["grid_thw"].tolist() == [[-(-num_frames // 2), 4, 6]]


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: to_frames(torch.zeros(2, 3), "tiles"), "unknown pixel layout 'tiles'"),
        (lambda: to_frames(torch.zeros(3, 4), "image"), "[C, H, W] or [T, C, H, W]"),
        (lambda: to_frames(torch.zeros(24, 1176), "qwen_patches"), "needs grid_thw"),
        (
            lambda: to_frames(torch.zeros(24, 1176), "qwen_patches", grid_thw=(1, 4, 5)),
            "not divisible by merge size 2",
        ),
        (
            lambda: to_frames(torch.zeros(23, 1176), "qwen_patches", grid_thw=(1, 4, 6)),
            "expects [24, C*392]",
        ),
        (lambda: from_frames(torch.zeros(1, 3, 56, 70), "qwen_patches"), "(56, 70)"),
        (lambda: from_frames(torch.zeros(2, 3, 4, 4), "image", video=False), "exactly 1 frame"),
        (lambda: grid_thw_tuple(torch.zeros(2, dtype=torch.long)), "three positive ints"),
        (lambda: grid_thw_tuple((1, 0, 2)), "[1, 0, 2]"),
        # a device tensor: reading it back is the caller's transfer (core/host.to_host)
        (lambda: grid_thw_tuple(torch.ones(3, device="meta")), "must be on the host"),
    ],
)
def test_bad_input_raises_media_input_error_naming_it(call, fragment: str) -> None:
    with pytest.raises(MediaInputError) as info:
        call()
    assert isinstance(info.value, MediaGuardError)
    assert not isinstance(info.value, MediaAlignmentError)  # a wrong call, not a data fault
    assert fragment in str(info.value)
