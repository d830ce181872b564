"""Qwen3-Omni's audio in video: the placeholder runs one video region interleaves.

``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` writes, between ``<|audio_start|>`` and
``<|audio_end|>``, the video's temporal grids and its clip's audio tokens in time order: grid
``g`` (``(h/2)(w/2)`` video pads) at time ``g * second_per_grid * position_id_per_seconds``,
audio token ``k`` at time ``k``, a video pad first on a tie. So before grid ``g`` come the audio
tokens ``k < time_g``; grids with no audio between them form one run. :func:`interleaved_runs`
is that arithmetic for every video at once, on the device; :func:`layout` pairs each video with
its clip from the ids as the model does. Each item's run lengths reach the merge's one verdict
on the device (``Encoded.runs``); the engine cuts the items into their runs after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..core.host import to_host
from ..errors import MediaInputError
from .spec import attr_path

_IMAGE, _VIDEO, _AIV, _AUDIO = 1, 2, 3, 4  # a region's kind, read at its start marker
_HF = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"


def clip_tokens(config: Any, kw) -> torch.Tensor:
    """Per clip, the tower's output length of its mel frames (transformers'
    ``_get_feat_extract_output_lengths``, torch ops) from ``feature_attention_mask`` (else
    ``audio_feature_lengths``), the tower's ``n_window`` (the thinker config's; Bridge's provider
    holds it as ``thinker_config``; 50, the function's default, where neither says)."""
    mask, lengths = kw.get("feature_attention_mask"), kw.get("audio_feature_lengths")
    frames = mask.sum(-1) if mask is not None else lengths
    if frames is None:
        raise MediaInputError(
            "qwen3_omni: input_features without feature_attention_mask or "
            "audio_feature_lengths (the forward needs one of them too)"
        )
    n_window = attr_path(config, "thinker_config.audio_config.n_window", "audio_config.n_window")
    count = importlib.import_module(_HF)._get_feat_extract_output_lengths
    return count(frames.long(), int(n_window or 50))


def seconds_per_grid(spg: torch.Tensor, tp: int) -> torch.Tensor:
    """``video_second_per_grid`` as the processor computed it, ``tp / fps`` in float64 (``tp``:
    the temporal patch size), from the tensor the model gets: a float32 row's frame rate is read
    back as the decimal of fewest digits (up to four) whose quotient rounds to the row, so that a
    tie (a grid's time on an audio token's) falls as the processor put it; float64 rows as they
    are. Torch ops, no transfer."""
    out = spg.double()
    if spg.dtype == torch.float64:
        return out
    found = out <= 0  # kept as it is
    for digits in range(5):
        fps = torch.round(tp / out * 10**digits) / 10**digits
        back = tp / fps
        hit = ~found & (fps != 0) & (back.to(spg.dtype) == spg)
        out, found = torch.where(hit, back, out), found | hit
    return out


def interleaved_runs(
    grid: torch.Tensor,
    second_per_grid: torch.Tensor,
    per_second: float,
    audio: torch.Tensor,
    slots: int,
    grids: int,
    merge: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(video, audio)``, each ``[v, slots]`` int64: per video (``grid`` ``[v, 3]``) its video
    runs' lengths and its clip's (``audio``: its tokens) audio runs' lengths, zero past them;
    the region reads video 0, audio 0, video 1, audio 1, ... ``second_per_grid``: float64
    (:func:`seconds_per_grid`), the times computed as the processor computes them; ``grids``
    bounds every ``t``, ``slots`` every video's runs (its clip's are at most as many)."""
    t, h, w = grid.long().unbind(-1)
    per_grid = (h // merge) * (w // merge)
    g = torch.arange(grids, device=grid.device)
    valid = g < torch.where(per_grid > 0, t, 0)[:, None]
    time = g * second_per_grid[:, None] * per_second
    before = torch.minimum(torch.ceil(time).clamp(min=0), audio[:, None].double()).long()
    before = torch.where(valid, before, 0)  # audio tokens k < time_g, written before grid g
    gap = before - F.pad(before[:, :-1], (1, 0))
    new = valid & ((g == 0) | (gap > 0))  # grid g opens a video run
    run = torch.cumsum(new, 1) - 1
    video = torch.zeros(grid.shape[0], slots, dtype=torch.long, device=grid.device)
    sound = torch.zeros_like(video)
    video.scatter_add_(1, run.clamp(0, slots - 1), torch.where(valid, per_grid[:, None], 0))
    sound.scatter_add_(1, (run - 1).clamp(0, slots - 1), torch.where(new, gap, 0))
    last = (new.sum(1, keepdim=True) - 1).clamp(min=0)  # the clip's tail after the last grid
    sound.scatter_add_(1, last, audio[:, None] - before.amax(1, keepdim=True))
    return video, sound


@dataclass(frozen=True)
class Layout:
    """One call's items on the device: per clip its tokens; under ``use_audio_in_video`` per
    modality each item's runs (``Encoded.runs``; one where no region pairs it) and sample, its
    region's row (``Encoded.sample``; -1 where regions and items differ in number); ``check``:
    ``Encoded.check``, a video region that disagrees with the flag."""

    tokens: torch.Tensor
    runs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    sample: Mapping[str, torch.Tensor] = field(default_factory=dict)
    check: tuple[torch.Tensor, Callable[[], None]] | None = None


def layout(model: Any, kw: MutableMapping[str, Any]) -> Layout:
    """:func:`layout_of`, once per call: the modalities' encodes share the call's ``kw`` (the
    engine's own dict), which keeps it under a private key."""
    if _KEY not in kw:
        kw[_KEY] = layout_of(model, kw)
    return kw[_KEY]


_KEY = "_media_guard_audio_in_video"


def layout_of(model: Any, kw) -> Layout:
    """No transfer. The k-th audio region (alone or in a video) takes clip k, the j-th video
    region video j, as the model's ``get_rope_index`` pairs them."""
    cfg, ids, flag = model.config, kw["input_ids"], bool(kw.get("use_audio_in_video"))
    x = kw.get("input_features")
    if flag and (x is None or not x.shape[0]):
        raise MediaInputError("qwen3_omni: use_audio_in_video=True and no audio clips")
    tokens = clip_tokens(cfg, kw)
    grid = kw.get("video_grid_thw")
    if grid is None:
        return Layout(tokens)
    kind = _kinds(ids, cfg)
    check = (torch.count_nonzero(kind == (_VIDEO if flag else _AIV)), lambda: _refuse(kind, flag))
    if not flag:
        return Layout(tokens, check=check)
    spg = kw.get("video_second_per_grid")
    if spg is None:
        raise MediaInputError("qwen3_omni: audio in video needs video_second_per_grid")
    flat, aiv = kind.reshape(-1), kind.reshape(-1) == _AIV
    regions = {"image": flat == _IMAGE, "video": (flat == _VIDEO) | aiv}
    regions["audio"] = aiv | (flat == _AUDIO)
    img = kw.get("image_grid_thw")
    n = {"image": 0 if img is None else img.shape[0], "video": grid.shape[0]}
    n["audio"] = tokens.shape[0]
    j, k = (torch.cumsum(regions[m], 0) - 1 for m in ("video", "audio"))  # per region its items
    clip = _nth(regions["video"], torch.where(aiv & (k < n["audio"]), k, -1), n["video"])
    video_of = _nth(regions["audio"], torch.where(aiv & (j < n["video"]), j, -1), n["audio"])
    # bounds, from shapes: t <= t*h*w/merge**2; a video's runs <= its clip's tokens + 1
    merge = int(getattr(cfg.vision_config, "spatial_merge_size", 2))
    grids = max(1, kw["pixel_values_videos"].shape[0] // merge**2)
    lengths = torch.arange(x.shape[-1] + 1)
    most = int(clip_tokens(cfg, {"audio_feature_lengths": lengths}).max())
    slots = max(1, min(grids, most + 1))
    tp = int(getattr(cfg.vision_config, "temporal_patch_size", 2))
    video, sound = interleaved_runs(
        grid,
        seconds_per_grid(spg, tp),
        cfg.position_id_per_seconds,
        torch.where(clip >= 0, tokens[clip.clamp(min=0)], 0),
        slots,
        grids,
        merge,
    )
    alone = F.pad(tokens.long()[:, None], (0, slots - 1))
    audio = torch.where(video_of[:, None] >= 0, sound[video_of.clamp(min=0)], alone)
    rows = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
    fits = torch.stack([torch.count_nonzero(regions[m]) == n[m] for m in n]).all()
    sample = {m: torch.where(fits, _nth(regions[m], rows, n[m]), -1) for m in n}
    return Layout(tokens, {"video": video, "audio": audio}, sample, check)


def _nth(mask: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: ``values`` at the first ``n`` positions of ``mask`` (token order), -1 past them."""
    idx = torch.cumsum(mask, 0) - 1
    keep = mask & (idx < n)
    out = values.new_full((n + 1,), -1)  # the last slot takes every other position
    out.scatter_reduce_(0, torch.where(keep, idx, n), torch.where(keep, values, -1), "amax")
    return out[:n]


def _kinds(ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    """``[b, s]``: each region's kind at its start marker, 0 elsewhere."""
    vs, a_s = cfg.vision_start_token_id, cfg.audio_start_token_id
    nxt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)
    after_vs = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids[:, :-1] == vs], 1)
    kind = torch.where(nxt == cfg.video_token_id, _VIDEO, torch.where(nxt == a_s, _AIV, 0))
    kind = torch.where(nxt == cfg.image_token_id, _IMAGE, kind)
    return torch.where(ids == vs, kind, torch.where((ids == a_s) & ~after_vs, _AUDIO, 0))


def _refuse(kind: torch.Tensor, flag: bool) -> None:
    """A video region that disagrees with ``use_audio_in_video``, named by its sample."""
    bad = (kind == (_VIDEO if flag else _AIV)).any(1).int().argmax()
    row = int(to_host(bad, why="the sample whose video region disagrees with the audio flag"))
    raise MediaInputError(
        f"qwen3_omni: sample {row} has a video region "
        f"{'without' if flag else 'with'} its audio track in a call with "
        f"use_audio_in_video={flag}: the model's get_rope_index miscounts its positions "
        "(and every later item's); pass use_audio_in_video=True exactly when every "
        "video carries its audio"
    )
