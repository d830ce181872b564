"""The Qwen3.5 fixture against the real transformers processor's arithmetic (no model): its
video ids and image counts. Aligned batches: ``tests/families/``; the plain class under the
faults and its batch layout: ``tests/test_fixture_plain.py``."""

from __future__ import annotations

import types

import pytest

from megatron_media_guard.geometry import PatchMergeGeometry
from megatron_media_guard.testing.families import qwen3_5 as F
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)


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
    b = F.make_batch(None, [[M("image", hw)]])
    grid = b.kwargs["image_grid_thw"]
    n = int(grid.prod()) // 4
    assert b.items == [(0, "image", n)] and b.runs == [[("image", n)]]
    geo = PatchMergeGeometry(patch=16, merge=2, min_pixels=32 * 32, max_pixels=F.MAX_PIXELS)
    assert geo.tokens(hw) == n
