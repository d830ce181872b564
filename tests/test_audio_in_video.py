"""The audio-in-video run arithmetic (``families/audio_in_video.py``, torch ops) against the
processor's own ``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` (transformers 5.24),
called on a minimal stand-in ``self`` holding the attributes it reads: hypothesis properties, and
the float32 ``video_second_per_grid`` the model gets read back to the processor's float64."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

from megatron_media_guard.families.audio_in_video import interleaved_runs, seconds_per_grid

STUB = SimpleNamespace(
    video_processor=SimpleNamespace(merge_size=2),
    audio_bos_token="<|audio_start|>",
    audio_eos_token="<|audio_end|>",
    video_token="<|video_pad|>",
    audio_token="<|audio_pad|>",
)


def processor_runs(grid, second_per_grid, per_second, audio_tokens):
    """The processor's placeholder string for one video and its clip, as runs."""
    text = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        STUB,
        {"video_grid_thw": np.array([grid]), "video_second_per_grid": [second_per_grid]},
        0,
        {"num_audio_tokens": np.array([audio_tokens])},
        0,
        position_id_per_seconds=per_second,
    )
    assert text.startswith("<|audio_start|>") and text.endswith("<|audio_end|>")
    body = text[len("<|audio_start|>") : -len("<|audio_end|>")]
    marks = body.replace("<|video_pad|>", "v").replace("<|audio_pad|>", "a")
    names = {"v": "video", "a": "audio"}
    return tuple((names[k], len(list(g))) for k, g in itertools.groupby(marks))


def guard_runs(grid, second_per_grid, per_second, audio_tokens):
    """:func:`interleaved_runs` of one video, as runs in token order (video 0, audio 0, ...),
    with the bounds the layout takes: grids <= t*h*w/4, runs <= audio tokens + 1."""
    grids = max(1, grid[0] * grid[1] * grid[2] // 4)
    spg = torch.as_tensor(second_per_grid, dtype=torch.float64).reshape(1)
    video, audio = interleaved_runs(
        torch.tensor([grid]),
        spg,
        per_second,
        torch.tensor([audio_tokens]),
        max(1, min(grids, audio_tokens + 1)),
        grids,
    )
    pairs = zip(video[0].tolist(), audio[0].tolist())
    return tuple((m, n) for v, a in pairs for m, n in (("video", v), ("audio", a)) if n)


GRID = st.tuples(st.integers(1, 12), st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 8]))
# frame rates as users write them: three decimals at most (0.25 ... 60; 29.97, 23.976)
FPS = st.integers(250, 60000).map(lambda c: c / 1000)


@settings(max_examples=300, deadline=None)
@given(
    grid=GRID,
    second_per_grid=st.floats(0.0, 8.0, allow_nan=False),
    per_second=st.sampled_from([13.0, 25, 12.5, 1.0]),
    audio_tokens=st.integers(0, 400),
)
def test_property_runs_equal_the_processors(grid, second_per_grid, per_second, audio_tokens):
    want = processor_runs(grid, second_per_grid, per_second, audio_tokens)
    assert guard_runs(grid, second_per_grid, per_second, audio_tokens) == want


@settings(max_examples=300, deadline=None)
@given(grid=GRID, fps=FPS, per_second=st.sampled_from([13.0, 25]), audio_tokens=st.integers(0, 400))
def test_property_float32_seconds_per_grid_read_back(grid, fps, per_second, audio_tokens):
    """The processor computes ``temporal_patch_size / fps`` in float64 (not the nearest double
    to the exact quotient where fps is a decimal such as 0.26), the model gets it as a float32
    tensor: read back, the runs equal the processor's, ties included."""
    spg = 2 / fps
    back = seconds_per_grid(torch.tensor([spg]), 2)
    want = processor_runs(grid, spg, per_second, audio_tokens)
    assert guard_runs(grid, back, per_second, audio_tokens) == want


@pytest.mark.parametrize(
    "grid, spg, per_second, n, want",
    [
        # two grids 26 ids apart, 30 audio tokens: 26 between them, 4 after
        ((2, 4, 4), 2.0, 13.0, 30, (("video", 4), ("audio", 26), ("video", 4), ("audio", 4))),
        # a short clip: the later grids run together
        ((3, 4, 4), 2.0, 13.0, 5, (("video", 4), ("audio", 5), ("video", 8))),
        # a grid on an audio token's time goes first
        ((2, 2, 2), 1.0, 2, 3, (("video", 1), ("audio", 2), ("video", 1), ("audio", 1))),
        ((2, 4, 4), 2.0, 13.0, 0, (("video", 8),)),  # a silent clip
    ],
)
def test_runs_table(grid, spg, per_second, n, want):
    assert guard_runs(grid, spg, per_second, n) == want
    assert processor_runs(grid, spg, per_second, n) == want


def test_a_float32_tie_would_fall_the_other_way_without_the_read_back():
    # fps 3: 2/3 in float32 is a little more than 2/3, so grid 3 (time 26) would come after
    # audio token 26 (the processor's float64 puts it first)
    spg32 = torch.tensor([2 / 3], dtype=torch.float32)
    raw = guard_runs((4, 2, 2), spg32.double(), 13.0, 40)
    back = guard_runs((4, 2, 2), seconds_per_grid(spg32, 2), 13.0, 40)
    assert back == processor_runs((4, 2, 2), 2 / 3, 13.0, 40) != raw
