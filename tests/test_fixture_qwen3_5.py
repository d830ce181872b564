"""The Qwen3.5 fixture against the real transformers class (tiny random config, CPU): aligned
batches equal each sample's own forward (final hidden states: the logits are their
``lm_head``, and cost 6x the rest over the 248k vocabulary), the real image processor's counts, and the unguarded
behaviour under a short run, +k/-k and a swap, as measured."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_media_guard.testing.families import qwen3_5 as F
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


_OWN: dict = {}


def own_logits(model, sample):
    key = repr(sample)
    if key not in _OWN:
        b = F.make_batch(model, [sample])
        _OWN[key] = F.plain_hidden(model, b)[0, : b.lengths[0]]
    return _OWN[key]


IMG_A, IMG_B = M("image", (64, 96)), M("image", (64, 64))  # 4x6 -> 6 tokens; 4x4 -> 4
IMG_T = M("image", (96, 64))  # 6x4 -> 6 tokens, the transpose of IMG_A
VID_A = M("video", (4, 64, 64))  # 2 groups of 4 tokens
VID_B = M("video", (2, 64, 96))  # 1 group of 6 tokens

ALIGNED = {
    "images": [[IMG_A, IMG_B], [IMG_B]],
    "videos": [[VID_A], [VID_B]],
    "mixed image+video": [[IMG_A, VID_A], [VID_B, IMG_B]],
}


@pytest.mark.parametrize("name", list(ALIGNED))
def test_aligned_each_sample_equals_its_own_forward(model, name):
    samples = ALIGNED[name]
    batch = F.make_batch(model, samples)
    logits = F.plain_hidden(model, batch)
    for k, sample in enumerate(samples):
        n = batch.lengths[k]
        torch.testing.assert_close(logits[k, :n], own_logits(model, sample), atol=1e-5, rtol=0)


def test_plain_logits_are_lm_head_of_plain_hidden(model):
    b = F.make_batch(model, [[IMG_B]])
    with torch.no_grad():
        want = model.lm_head(F.plain_hidden(model, b))
    torch.testing.assert_close(F.plain_logits(model, b), want)


def test_batch_layout(model):
    b = F.make_batch(model, [[IMG_A, VID_A], [IMG_B]])
    kw = b.kwargs
    assert kw["pixel_values"].shape == (24 + 16, 3 * 2 * 16 * 16)
    assert kw["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4]]
    assert kw["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert kw["pixel_values_videos"].shape == (2 * 16, 1536)
    assert b.items == [(0, "image", 6), (1, "image", 4), (0, "video", 8)]
    assert b.runs == [[("image", 6), ("video", 4), ("video", 4)], [("image", 4)]]
    tt = kw["mm_token_type_ids"]
    assert torch.equal(tt == 1, b.input_ids == F.IMAGE) and torch.equal(
        tt == 2, b.input_ids == F.VIDEO
    )
    assert int((b.input_ids == F.VISION_START).sum()) == 4  # one per image and per temporal group


@pytest.mark.parametrize("frames", [1, 4, 5])
def test_video_ids_follow_replace_video_token(frames):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor as P

    b = F.make_batch(None, [[M("video", (frames, 64, 64))]], text_len=0)
    grid = b.kwargs["video_grid_thw"]
    proc = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
        _calculate_timestamps=lambda *a: P._calculate_timestamps(None, *a),
    )
    meta = types.SimpleNamespace(fps=F.FPS, frames_indices=list(range(frames)))
    text = P.replace_video_token(proc, {"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    marks = {
        "<|vision_start|>": F.VISION_START,
        "<|vision_end|>": F.VISION_END,
        "<|video_pad|>": F.VIDEO,
    }
    want: list[int] = []
    for piece in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
        want += [marks[piece]] if piece in marks else F.char_ids(piece)
    assert b.input_ids[0].tolist() == want


@pytest.mark.parametrize("hw", [(64, 96), (50, 50), (200, 90), (17, 300)])
def test_image_counts_are_the_processors_and_the_geometrys(hw):
    from megatron_media_guard.geometry import PatchMergeGeometry

    b = F.make_batch(None, [[M("image", hw)]])
    grid = b.kwargs["image_grid_thw"]
    n = int(grid.prod()) // 4
    assert b.items == [(0, "image", n)] and b.runs == [[("image", n)]]
    geo = PatchMergeGeometry(patch=16, merge=2, min_pixels=32 * 32, max_pixels=F.MAX_PIXELS)
    assert geo.tokens(hw) == n


# ---- unguarded, measured ------------------------------------------------------------------

RAISES = {
    "short image run": (
        [[M("image", (64, 96), tokens=5)]],
        None,
        ValueError,
        r"Image features and image tokens do not match, tokens: 5, features: 6",
    ),
    "short video run": (
        [[M("video", (4, 64, 64), tokens=7)]],
        None,
        ValueError,
        r"Video features and video tokens do not match, tokens: 7, features: 8",
    ),
    # the merge passes (totals agree); get_rope_index then lays a grid's positions over a run
    # of another length
    "+k/-k images": (
        [[M("image", (64, 96), tokens=8)], [M("image", (64, 64), tokens=2)]],
        None,
        RuntimeError,
        r"shape mismatch: value tensor of shape \[3, \d+\] cannot be broadcast to indexing result",
    ),
    "+k/-k video groups": (
        [[M("video", (4, 64, 64), tokens=9)], [M("video", (4, 64, 64), tokens=7)]],
        None,
        RuntimeError,
        r"shape mismatch: value tensor of shape \[3, \d+\]",
    ),
    "swap images of different size": (
        [[IMG_A], [IMG_B]],
        (0, 1),
        RuntimeError,
        r"shape mismatch: value tensor of shape \[3, \d+\]",
    ),
    "swap videos of different size": (
        [[VID_A], [VID_B]],
        (0, 1),
        RuntimeError,
        r"shape mismatch: value tensor of shape \[3, \d+\]",
    ),
}


@pytest.mark.parametrize("name", list(RAISES))
def test_unguarded_raises_naming_no_sample(model, name):
    samples, swap, exc, match = RAISES[name]
    with pytest.raises(exc, match=match):
        F.plain_hidden(model, F.make_batch(model, samples, swap=swap))


def test_unguarded_swap_of_equal_count_images_runs_silently(model):
    """4x6 and 6x4 grids: counts equal, so neither the merge nor get_rope_index sees it; each
    sample's run holds the other's features (and rope positions of the other's grid)."""
    samples = [[IMG_A], [IMG_T]]
    batch = F.make_batch(model, samples, swap=(0, 1))
    logits = F.plain_hidden(model, batch)
    for k, sample in enumerate(samples):
        ref = own_logits(model, sample)
        first = int((batch.input_ids[k] == F.IMAGE).nonzero()[0])
        n = batch.lengths[k]
        torch.testing.assert_close(logits[k, :first], ref[:first], atol=1e-5, rtol=0)
        assert (logits[k, first:n] - ref[first:n]).abs().max() > 1e-3
