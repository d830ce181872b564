"""Qwen3-Omni's audio in video: the placeholder runs one video region interleaves.

``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` writes, between
``<|audio_start|>`` and ``<|audio_end|>``, the video's temporal grids and its clip's audio
tokens in time order: grid ``t`` (``(h/2)(w/2)`` video pads) at time
``t * second_per_grid * position_id_per_seconds``, audio token ``k`` at time ``k``, a video pad
first on a tie. So before grid ``t`` come the audio tokens ``k < time_t``; grids with no audio
between them form one run. :func:`interleaved_runs` is that arithmetic (pure, host);
:func:`chunks` reads one call's regions from its ids and pairs each such video with its clip
as the model does, so that the spec cuts both into the runs' items (:func:`cut`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..core.host import to_host
from ..errors import MediaInputError
from .spec import Encoded

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


def seconds_per_grid(values: Sequence[float], dtype: torch.dtype, tp: int) -> list[float]:
    """``video_second_per_grid`` as the processor computed it, ``temporal_patch_size / fps`` in
    float64 (``tp``: the temporal patch size), from the rows of the ``dtype`` tensor the model
    gets: for a float32 row the frame rate is read back as the decimal of fewest digits (up to
    four) whose quotient rounds to the row, and the quotient taken in float64 as the processor
    takes it, so that a tie (a grid's time on an audio token's) falls as the processor put it;
    float64 rows are taken as they are."""
    out = []
    for v in values:
        fps = [round(tp / v, d) for d in range(5)] if v > 0 and dtype != torch.float64 else []
        for f in (tp / r for r in fps if r):
            if torch.tensor(f, dtype=dtype).item() == v:
                v = f
                break
        out.append(v)
    return out


_IMAGE, _VIDEO, _AIV, _AUDIO = 1, 2, 3, 4  # a region's kind, read at its start marker
_INPUTS = ("feature_attention_mask", "video_grid_thw", "video_second_per_grid", "image_grid_thw")


@dataclass(frozen=True)
class Chunks:
    """One call's items cut as its ids interleave them: per clip its audio token count (token
    order, as the model pairs them); per video / clip in an audio-in-video region the lengths of
    its runs there (items absent: one run each); under ``use_audio_in_video`` per modality each
    model-level item's sample, the row of its region (empty where the regions and the items
    differ in number: the alignment then pairs them as for any family)."""

    clip_tokens: tuple[int, ...]
    video: Mapping[int, tuple[int, ...]]
    audio: Mapping[int, tuple[int, ...]]
    sample: Mapping[str, tuple[int, ...]]


def chunks(model: Any, kw: Mapping[str, Any], count: Callable) -> Chunks:
    """The clips' token counts (one transfer); where the call holds videos and clips, or passes
    ``use_audio_in_video=True``, with the regions' kinds from the ids (sized by the regions), the
    grids and ``video_second_per_grid``, each video paired with its clip as the model's
    ``get_rope_index`` does: the k-th audio region (alone or in a video) takes clip k, the j-th
    video region video j. ``count``: the model's ``_get_feat_extract_output_lengths``. A video
    region without its audio under ``use_audio_in_video=True``, or one with it without, is
    refused (the model's positions miscount both, silently)."""
    cfg, ids, flag = model.config, kw["input_ids"], bool(kw.get("use_audio_in_video"))
    _, grid, spg, img = (kw.get(n) for n in _INPUTS)
    frames = _frames(kw)
    if flag and not frames.numel():
        raise MediaInputError("qwen3_omni: use_audio_in_video=True and no audio clips")
    parts, n = [clip_tokens(model, kw, count)], 0
    grid = grid if grid is not None else ids.new_zeros(0, 3)
    if flag or (grid.numel() and frames.numel()):  # which videos and clips are paired
        vs, a_s = cfg.vision_start_token_id, cfg.audio_start_token_id
        nxt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)
        after_vs = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids[:, :-1] == vs], 1)
        kind = torch.where(nxt == cfg.video_token_id, _VIDEO, torch.where(nxt == a_s, _AIV, 0))
        kind = torch.where(nxt == cfg.image_token_id, _IMAGE, kind)
        kind = torch.where(ids == vs, kind, torch.where((ids == a_s) & ~after_vs, _AUDIO, 0))
        at = torch.nonzero(kind)  # row-major: token order
        n = at.shape[0]
        parts = [at[:, 0], kind[at[:, 0], at[:, 1]], parts[0], grid]
        parts += [spg] if spg is not None else []
    host = to_host(
        torch.cat([p.reshape(-1).double() for p in parts]),
        why="region kinds, grids and clip lengths to cut audio-in-video items",
    ).tolist()
    c, v = frames.shape[0], grid.shape[0]
    rows, kinds, tokens = host[:n], host[n : 2 * n], [int(x) for x in host[2 * n : 2 * n + c]]
    grids = [tuple(int(x) for x in host[2 * n + c + 3 * j :][:3]) for j in range(v)]
    video, audio, j, k = {}, {}, 0, 0
    rows_of: dict[str, list[int]] = {"image": [], "video": [], "audio": []}
    for row, kd in zip(rows, kinds):
        if kd in (_VIDEO, _AIV) and (kd == _AIV) != flag:
            raise MediaInputError(
                f"qwen3_omni: sample {int(row)} has a video region "
                f"{'without' if flag else 'with'} its audio track in a call with "
                f"use_audio_in_video={flag}: the model's get_rope_index miscounts its positions "
                "(and every later item's); pass use_audio_in_video=True exactly when every "
                "video carries its audio"
            )
        if kd == _AIV and j < v and k < c:
            if spg is None:
                raise MediaInputError("qwen3_omni: audio in video needs video_second_per_grid")
            (sec,) = seconds_per_grid([host[2 * n + c + 3 * v + j]], spg.dtype, _tp(cfg))
            runs = interleaved_runs(grids[j], sec, cfg.position_id_per_seconds, tokens[k])
            video[j] = tuple(x for m, x in runs if m == "video")
            audio[k] = tuple(x for m, x in runs if m == "audio")
        for m in ("image",) * (kd == _IMAGE) + ("video",) * (kd in (_VIDEO, _AIV)):
            rows_of[m].append(int(row))
        rows_of["audio"] += [int(row)] * (kd in (_AIV, _AUDIO))
        j += kd in (_VIDEO, _AIV)
        k += kd in (_AIV, _AUDIO)
    want = {"image": img.shape[0] if img is not None else 0, "video": v, "audio": c}
    fits = flag and all(len(rows_of[m]) == want[m] for m in want)
    sample = {m: tuple(r) for m, r in rows_of.items()} if fits else {}
    return Chunks(tuple(tokens), video, audio, sample)


def _frames(kw: Mapping[str, Any]) -> torch.Tensor:
    """Per clip its mel frames (``feature_attention_mask``, else ``audio_feature_lengths``)."""
    mask = kw.get("feature_attention_mask")
    frames = mask.sum(-1) if mask is not None else kw.get("audio_feature_lengths")
    return frames if frames is not None else kw["input_ids"].new_zeros(0)


def clip_tokens(model: Any, kw: Mapping[str, Any], count: Callable) -> torch.Tensor:
    """Per clip its audio token count on the device (``count``: the model's
    ``_get_feat_extract_output_lengths``), no transfer."""
    return count(_frames(kw), model.config.audio_config.n_window)


def separate(model: Any, kw: Mapping[str, Any], count: Callable):
    """Without ``use_audio_in_video`` no region interleaves a video and a clip: the clips are
    cut by their counts alone, which the merge reads with its verdict (``Encoded.counts``),
    and a video region holding audio is refused from a device count read with it
    (``Encoded.check``; the refusal is :func:`chunks`'s, naming the sample). Returns
    ``(counts, check)``, or None under ``use_audio_in_video`` (:func:`chunks` reads the
    regions)."""
    if kw.get("use_audio_in_video"):
        return None
    check = None
    if kw.get("video_grid_thw") is not None:
        ids, cfg = kw["input_ids"], model.config
        nxt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)
        held = (ids == cfg.vision_start_token_id) & (nxt == cfg.audio_start_token_id)
        check = (torch.count_nonzero(held), lambda: chunks(model, kw, count))
    return clip_tokens(model, kw, count), check


def chunks_once(model: Any, kw: MutableMapping[str, Any], count: Callable) -> Chunks:
    """:func:`chunks`, read once per call: the modalities' encodes share the call's ``kw``
    (the engine's own dict), which keeps the result under a private key."""
    if _KEY not in kw:
        kw[_KEY] = chunks(model, kw, count)
    return kw[_KEY]


_KEY = "_media_guard_audio_in_video"


def _tp(cfg: Any) -> int:
    return int(getattr(cfg.vision_config, "temporal_patch_size", 2))


def encoded(model: Any, kw, count: Callable, kind: str, feats, output: Any = None) -> Encoded:
    """``kind``'s items under ``use_audio_in_video``: ``feats`` (per item; audio: the clips
    back to back, one block) cut into the runs their regions interleave (:func:`chunks`)."""
    got = chunks_once(model, kw, count)
    if kind == "audio":
        feats = feats[0].split(list(got.clip_tokens))
    pieces, parent, sample = cut(feats, getattr(got, kind, {}), got.sample.get(kind))
    return Encoded(pieces, parent=parent, sample=sample, output=output)


def cut(features: Sequence[torch.Tensor], sizes: Mapping[int, tuple[int, ...]], samples=()):
    """``(pieces, parent, sample)``: each item's features cut by its ``sizes`` (absent: whole),
    per piece the item it came from (``Encoded.parent``) and, given ``samples`` (per item), its
    sample (``Encoded.sample``; else empty)."""
    pieces, parent = [], []
    for i, f in enumerate(features):
        got = f.split(list(sizes[i])) if i in sizes and sum(sizes[i]) == f.shape[0] else (f,)
        pieces += got
        parent += [i] * len(got)
    return tuple(pieces), tuple(parent), tuple(samples[i] for i in parent) if samples else ()
