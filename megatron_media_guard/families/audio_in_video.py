"""Qwen3-Omni's audio in video: the placeholder runs one video region interleaves.

``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` writes, between
``<|audio_start|>`` and ``<|audio_end|>``, the video's temporal grids and its clip's audio
tokens in time order: grid ``t`` (``(h/2)(w/2)`` video pads) at time
``t * second_per_grid * position_id_per_seconds``, audio token ``k`` at time ``k``, a video pad
first on a tie. So before grid ``t`` come the audio tokens ``k < time_t``; grids with no audio
between them form one run. Pure host arithmetic (plus :func:`seconds_per_grid`, which reads
the seconds the processor computed back from their float32 tensor).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Run = tuple[Literal["video", "audio"], int]


def interleaved_runs(
    grid_thw: tuple[int, int, int],
    second_per_grid: float,
    position_id_per_seconds: float,
    audio_tokens: int,
    merge: int = 2,
) -> tuple[Run, ...]:
    """The (modality, length) runs of one audio-in-video region, in token order.

    ``second_per_grid`` as the processor held it (a float64; see :func:`seconds_per_grid`);
    the times are computed as it computes them (``t * second_per_grid * per_second``)."""
    t, h, w = grid_thw
    per_grid = (h // merge) * (w // merge)
    runs: list[Run] = []
    placed = 0  # audio tokens written so far
    for g in range(t if per_grid else 0):
        time = g * second_per_grid * position_id_per_seconds
        before = min(audio_tokens, max(0, math.ceil(time)))  # audio k < time comes first
        if before > placed:
            runs.append(("audio", before - placed))
            placed = before
        if runs and runs[-1][0] == "video":
            runs[-1] = ("video", runs[-1][1] + per_grid)
        else:
            runs.append(("video", per_grid))
    if audio_tokens > placed:
        runs.append(("audio", audio_tokens - placed))
    return tuple(runs)


def seconds_per_grid(values: torch.Tensor, temporal_patch_size: int) -> list[float]:
    """``video_second_per_grid`` as the processor computed it, ``temporal_patch_size / fps`` in
    float64, from the tensor the model gets: for a float32 row the frame rate is read back as
    the decimal of fewest digits (up to four) whose quotient rounds to the row, and the quotient
    is taken in float64 as the processor takes it, so that a tie (a grid's time on an audio
    token's) falls as the processor put it; float64 rows are taken as they are."""
    out = []
    for v in values.tolist():
        fps = [round(temporal_patch_size / v, d) for d in range(5)] if v > 0 else []
        for r in fps if values.dtype != torch.float64 else ():
            f = temporal_patch_size / r if r else None
            if f is not None and torch.tensor(f, dtype=values.dtype).item() == v:
                v = f
                break
        out.append(v)
    return out
