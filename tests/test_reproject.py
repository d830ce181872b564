"""Re-projection: resize, re-encode to the target count, FP8 padding, errors and gradients."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from einops import rearrange
from torch import nn

from megatron_media_guard.errors import MediaAlignmentError, MediaInputError
from megatron_media_guard.repair import fp8
from megatron_media_guard.repair.pixels import from_frames, to_frames
from megatron_media_guard.repair.reproject import ReencodeResult, reencode, resize_frames

PATCH, TP, MERGE = 14, 2, 2
PATCH_DIM = 3 * TP * PATCH * PATCH


@dataclass(frozen=True)
class Target:
    """Stand-in for geometry.Solution (the fields reencode reads)."""

    tokens: int
    size_hw: tuple[int, int] | None
    grid: tuple[int, int] | None = None
    reachable: bool = True
    reason: str | None = None


class QwenLikeEncoder(nn.Module):
    """Patch-embedding Linear + 2x2 merger, like Qwen2-VL's tower without attention:
    ``[n, C*tp*p*p]`` -> ``[n / 4, out]``; records its inputs and (row count, grid) calls."""

    def __init__(self, hidden: int = 32, out: int = 24) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(PATCH_DIM, hidden)
        self.merger = nn.Linear(hidden * MERGE * MERGE, out)
        self.calls: list[tuple[int, list[list[int]]]] = []
        self.inputs: list[torch.Tensor] = []

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        self.calls.append((patches.shape[0], grid_thw.tolist()))
        self.inputs.append(patches)
        x = self.embed(patches)
        return self.merger(rearrange(x, "(n m) h -> n (m h)", m=MERGE * MERGE))


class ImageEncoder(nn.Module):
    """Conv patch embed (patch 14) + 2x2 merge: ``[C, H, W]`` -> ``[(H/28)*(W/28), out]``."""

    def __init__(self, hidden: int = 16, out: int = 24) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Conv2d(3, hidden, PATCH, stride=PATCH)
        self.merger = nn.Linear(hidden * 4, out)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.embed(image.unsqueeze(0))[0]
        x = rearrange(x, "h (a mh) (b mw) -> (a b) (mh mw h)", mh=2, mw=2)
        return self.merger(x)


def qwen_item(height: int = 56, width: int = 84, frames: int = 1, seed: int = 0):
    """(pixel_values [t*h*w, 1176], grid_thw [1, 3]) for a random normalized image or video."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(frames, 3, height, width, generator=g)
    if frames == 1:
        video = video.expand(TP, -1, -1, -1)
    patches, meta = from_frames(video, "qwen_patches")
    return patches, meta["grid_thw"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("src", "dst"),
    [((56, 84), (84, 112)), ((90, 60), (28, 56)), ((7, 9), (8, 9)), ((28, 28), (28, 28))],
)
def test_resize_gives_exact_size_and_keeps_dtype(dtype, src, dst) -> None:
    frames = torch.randn(2, 3, *src).to(dtype)
    out = resize_frames(frames, dst)
    assert out.shape == (2, 3, *dst)
    assert out.dtype == dtype and out.device == frames.device
    assert torch.isfinite(out.float()).all()
    assert (out is frames) == (src == dst)  # the same size: the input itself


def test_resize_preserves_constants_and_commutes_with_normalization() -> None:
    constant = torch.full((1, 3, 40, 60), 0.7)
    torch.testing.assert_close(resize_frames(constant, (23, 71)), torch.full((1, 3, 23, 71), 0.7))

    raw = torch.rand(2, 3, 56, 84)
    mean = torch.tensor([0.48, 0.46, 0.41]).view(1, 3, 1, 1)
    std = torch.tensor([0.27, 0.26, 0.28]).view(1, 3, 1, 1)
    resized_then_normalized = (resize_frames(raw, (42, 70)) - mean) / std
    normalized_then_resized = resize_frames((raw - mean) / std, (42, 70))
    torch.testing.assert_close(
        normalized_then_resized, resized_then_normalized, rtol=1e-4, atol=1e-4
    )


def test_resize_uint8_rounds_and_clamps() -> None:
    frames = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)
    frames[..., 4:] = 255  # a hard edge: bicubic overshoots both ways
    out = resize_frames(frames, (8, 13))
    assert out.dtype == torch.uint8 and out.shape == (1, 1, 8, 13)
    assert out.min() == 0 and out.max() == 255


@pytest.mark.parametrize(
    ("size_hw", "frames", "tokens", "dtype"),
    [
        ((84, 112), 1, 12, torch.float32),
        ((28, 56), 1, 2, torch.float32),
        ((56, 56), 4, 8, torch.float32),
        ((112, 84), 3, 24, torch.float32),
        ((84, 112), 1, 12, torch.bfloat16),  # the input's dtype is kept
        ((84, 112), 1, 12, None),  # no size: the solution's grid (6x8) times the patch
        ((84, 112), 2, 12, torch.float32),
    ],
)
def test_reencode_qwen_patches_gives_target_count(size_hw, frames, tokens, dtype) -> None:
    patches, grid_thw = qwen_item(frames=frames)
    original = patches.clone()
    encoder = QwenLikeEncoder().to(dtype or torch.float32)
    target = Target(tokens, size_hw) if dtype else Target(tokens, None, grid=(6, 8))
    pixels = patches.to(encoder.embed.weight.dtype)
    result = reencode(pixels, "qwen_patches", target, encoder, grid_thw=grid_thw)
    # the encoder is fed patchify(resize(recover(pixels))), bit for bit
    recovered = to_frames(pixels, "qwen_patches", grid_thw=grid_thw)
    expected, _ = from_frames(resize_frames(recovered, size_hw), "qwen_patches")
    assert torch.equal(encoder.inputs[0], expected)

    assert isinstance(result, ReencodeResult)
    assert result.features.shape == (tokens, 24)
    assert result.features.dtype == encoder.embed.weight.dtype
    assert result.size_hw == size_hw
    t = -(-frames // TP)
    assert result.grid_thw == (t, size_hw[0] // PATCH, size_hw[1] // PATCH)
    assert result.grid == (size_hw[0] // PATCH, size_hw[1] // PATCH)
    assert result.num_frames == t * TP and result.fp8_pad == 0
    assert encoder.calls == [(tokens * 4, [list(result.grid_thw)])]
    assert torch.equal(patches, original)  # the caller's tensor is not touched


@pytest.mark.parametrize("video", [False, True])
def test_reencode_image_layout(video: bool) -> None:
    image = torch.randn(3, 56, 84)
    pixels = image.unsqueeze(0) if video else image
    calls: list[tuple[int, ...]] = []
    inner = ImageEncoder()

    def encoder(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return inner(x[0] if video else x)

    result = reencode(pixels, "image", Target(12, (84, 112), grid=(6, 8)), encoder)
    assert result.features.shape == (12, 24)
    assert calls == [(1, 3, 84, 112) if video else (3, 84, 112)]
    assert result.grid == (6, 8) and result.grid_thw is None and result.num_frames == 1


class VisionOOM(RuntimeError):
    pass


def one_short(p: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return QwenLikeEncoder()(p, grid_thw)[:-1]


def out_of_memory(p: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    raise VisionOOM("CUDA out of memory (simulated)")


SHORT = "gave 11 features for 12 placeholder tokens"


@pytest.mark.parametrize(
    ("target", "encoder", "error", "match"),
    [
        # the encoder's faults: a short output is named, its own error propagates unchanged
        (Target(12, (84, 112)), one_short, MediaAlignmentError, SHORT),
        (Target(12, (84, 112)), out_of_memory, VisionOOM, "simulated"),
        # a target at odds with itself (encoder None) raises before anything is encoded
        (Target(13, (84, 112)), None, MediaAlignmentError, "gives 12 tokens"),
        (Target(12, (84, 100)), None, MediaInputError, "not a multiple of patch*merge"),
        (Target(12, None), None, MediaAlignmentError, "no pixel size"),
        (Target(12, None, reachable=False, reason="prime N"), None, MediaAlignmentError, "prime N"),
    ],
)
def test_encoder_faults_and_inconsistent_targets_are_named(target, encoder, error, match) -> None:
    patches, grid_thw = qwen_item()
    spy = QwenLikeEncoder()
    with pytest.raises(error, match=re.escape(match)) as info:
        reencode(patches, "qwen_patches", target, encoder or spy, grid_thw=grid_thw)
    assert encoder is not None or spy.calls == []  # a bad target: nothing was encoded
    if match == SHORT:
        assert info.value.context["expected"] == 12 and info.value.context["got"] == 11


def test_fp8_padding_through_the_config_flag_keeps_features_and_gradients() -> None:
    patches, grid_thw = qwen_item()
    multiple = fp8.fp8_multiple(config_flag=True)
    assert multiple == 16 and fp8.fp8_multiple(config_flag=False) is None
    encoder = QwenLikeEncoder()
    target = Target(12, (84, 112))  # 48 patch rows: already a multiple of 16
    target_odd = Target(6, (56, 84))  # 24 patch rows -> padded to 32
    plain = reencode(patches, "qwen_patches", target_odd, encoder, grid_thw=grid_thw)
    fp8_on = {"grid_thw": grid_thw, "fp8_multiple": multiple}
    padded = reencode(patches, "qwen_patches", target_odd, encoder, **fp8_on)
    aligned = reencode(patches, "qwen_patches", target, encoder, **fp8_on)
    assert [rows for rows, _ in encoder.calls] == [24, 32, 48]
    assert padded.fp8_pad == 8 and aligned.fp8_pad == 0
    assert padded.features.shape == (6, 24)
    torch.testing.assert_close(padded.features, plain.features)
    padded.features.square().sum().backward()  # gradients reach every encoder parameter
    for name, param in encoder.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("n", "multiple", "n_pad"), [(24, 16, 8), (32, 16, 0), (1, 32, 31), (130, 128, 126)]
)
def test_pad_for_fp8(n: int, multiple: int, n_pad: int) -> None:
    x = torch.randn(n, 8, requires_grad=True)
    padded, got_pad = fp8.pad_for_fp8(x, multiple)
    assert got_pad == n_pad and padded.shape == (n + n_pad, 8)
    assert torch.equal(padded[:n], x) and not padded[n:].any()


def test_padding_multiple_keeps_whole_merge_groups() -> None:
    assert fp8.padded_multiple(16, 4) == 16
    assert fp8.padded_multiple(6, 4) == 12
    with pytest.raises(MediaInputError):
        fp8.padded_multiple(0, 4)


def test_fp8_detection_reads_transformer_engine_when_flag_is_none(monkeypatch) -> None:
    assert fp8.fp8_active(True) and not fp8.fp8_active(False)
    monkeypatch.setattr(fp8, "_te_state_module", lambda: None)
    assert fp8.fp8_active(None) is False
    assert fp8.fp8_multiple(True) == 16 and fp8.fp8_multiple(True, 8) == 8

    def fake_te(enabled: bool, mxfp8: bool, with_align: bool) -> SimpleNamespace:
        recipe = SimpleNamespace(mxfp8=lambda: mxfp8)
        manager = SimpleNamespace(is_fp8_enabled=lambda: enabled, get_fp8_recipe=lambda: recipe)
        module = SimpleNamespace(FP8GlobalStateManager=manager)
        if with_align:
            module.get_align_size_for_quantization = lambda r: 32 if r.mxfp8() else 16
        return module

    for enabled, mxfp8, with_align, expected in [
        (True, False, True, 16),
        (True, True, True, 32),
        (True, True, False, 32),
        (False, True, True, None),
    ]:
        module = fake_te(enabled, mxfp8, with_align)
        monkeypatch.setattr(fp8, "_te_state_module", lambda m=module: m)
        assert fp8.fp8_active(None) is enabled
        assert fp8.fp8_multiple(None) == expected
        assert fp8.fp8_active(False) is False  # the flag wins over detection


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reencode_on_cuda() -> None:
    patches, grid_thw = qwen_item()
    encoder = QwenLikeEncoder().cuda()
    result = reencode(
        patches.cuda(),
        "qwen_patches",
        Target(12, (84, 112)),
        encoder,
        grid_thw=grid_thw,  # on the host: reading a device tensor is the caller's transfer
        fp8_multiple=16,
    )
    assert result.features.device.type == "cuda" and result.features.shape == (12, 24)
    cpu = reencode(patches, "qwen_patches", Target(12, (84, 112)), encoder.cpu(), grid_thw=grid_thw)
    torch.testing.assert_close(result.features.cpu(), cpu.features, rtol=1e-3, atol=1e-3)
