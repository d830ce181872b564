"""Qwen3-Omni thinker (transformers ``Qwen3OmniMoeThinkerForConditionalGeneration``), tiny and random.

Grammar (``Qwen3OmniMoeProcessor`` + chat template): an image is ``<|vision_start|>``
``<|image_pad|>``×(t·h·w/4) ``<|vision_end|>``; a video is ONE run ``<|vision_start|>``
``<|video_pad|>``×(t·h·w/4) ``<|vision_end|>``; an audio clip is ``<|audio_start|>``
``<|audio_pad|>``×n ``<|audio_end|>`` with n = ``_get_feat_extract_output_lengths(L)`` of its L mel
frames. A video with its audio track (``use_audio_in_video``) is ONE region
``<|vision_start|>`` ``<|audio_start|>`` interleaved video / audio pads ``<|audio_end|>``
``<|vision_end|>``, written by the processor's own ``replace_video_with_audio_token`` (called on
a stand-in ``self``, see :func:`interleaved`); its clip takes its place among the audio clips.

Ids come from the thinker config (``image_token_id``, ``video_token_id``, ``audio_token_id``,
``audio_start_token_id``); the config class lacks ``vision_start_token_id`` (its rope code reads it),
so ``tiny_model`` sets 151652 as the checkpoints' config.json do. ``<|vision_end|>`` and
``<|audio_end|>`` are tokenizer-only: the stand-ins ``VISION_END`` / ``AUDIO_END`` are the Qwen
tokenizer's ids next to the config's starts. No tokenizer is loaded; text is random ids below 100000.
Pixels are random ``[Σ patches, 3·2·16·16]`` float32 rows; audio is random ``input_features``
``[n_audio, 128, L_max]`` right-padded with zeros, ``feature_attention_mask`` ``[n_audio, L_max]``
int32, as ``WhisperFeatureExtractor(padding=True)`` gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import torch

from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "qwen3_omni"

PATCH = 16
TEMPORAL_PATCH = 2
MERGE = 2
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH
MEL_BINS = 128
N_WINDOW = 50
VISION_START = 151652
VISION_END = 151653  # tokenizer-only: <|vision_end|>
AUDIO_END = 151648  # tokenizer-only: <|audio_end|> (the config's audio_start_token_id is 151647)
FPS = 1.0  # the processor's default; video_second_per_grid = temporal_patch_size / fps
SECONDS_PER_GRID = TEMPORAL_PATCH / FPS
PAD_ID = 0
ORDER = ("audio", "image", "video")  # the forward's merge order


def tiny_model(seed: int = 0, **overrides):
    """Tiny random thinker (vision depth 1 with deepstack at layer 0, audio 1 layer, 1 MoE text
    layer of 4 experts, hidden 32, vocab 151680). ``overrides`` update the thinker config; pass
    ``vision_start_token_id=None`` to leave it unset as the config class does."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerConfig,
    )

    text = dict(
        vocab_size=151680,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "interleaved": True,
        },
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=32,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    audio = dict(
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=32,
        downsample_hidden_size=8,
        num_mel_bins=MEL_BINS,
    )
    vision_start = overrides.pop("vision_start_token_id", VISION_START)
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, **overrides
    )
    if vision_start is not None:
        cfg.vision_start_token_id = vision_start
    torch.manual_seed(seed)
    return Qwen3OmniMoeThinkerForConditionalGeneration(cfg).eval().float()


def audio_tokens(mel_frames: int, n_window: int = N_WINDOW) -> int:
    """``_get_feat_extract_output_lengths``: placeholders for a clip of ``mel_frames`` (160-sample hops)."""
    chunk = n_window * 2
    rest = mel_frames % chunk
    feat = (rest - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (mel_frames // chunk) * 13


def interleaved(model, grid: tuple[int, int, int], mel_frames: int, fps: float = FPS) -> list[int]:
    """The ids between ``<|vision_start|>`` and ``<|vision_end|>`` of a video of temporal /
    patch grid ``grid`` with its audio track of ``mel_frames`` frames: the processor's own
    ``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` on a stand-in ``self`` (one-letter
    tokens, mapped to the config's ids), ``position_id_per_seconds`` from the config."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor,
    )

    stub = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=MERGE),
        audio_bos_token="s",
        audio_eos_token="e",
        video_token="v",
        audio_token="a",
    )
    text = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        stub,
        {"video_grid_thw": np.array([grid]), "video_second_per_grid": [TEMPORAL_PATCH / fps]},
        0,
        {"num_audio_tokens": np.array([audio_tokens(mel_frames)])},
        0,
        position_id_per_seconds=model.config.position_id_per_seconds,
    )
    cfg = model.config
    ids = {"s": cfg.audio_start_token_id, "e": AUDIO_END, "v": cfg.video_token_id}
    return [ids.get(c, cfg.audio_token_id) for c in text]


def interleaved_runs(model, grid, mel_frames: int, fps: float = FPS) -> list[tuple[str, int]]:
    """The (modality, length) runs of :func:`interleaved`, in token order."""
    pads = {model.config.video_token_id: "video", model.config.audio_token_id: "audio"}
    runs: list[tuple[str, int]] = []
    for t in interleaved(model, grid, mel_frames, fps)[1:-1]:
        if runs and runs[-1][0] == pads[t]:
            runs[-1] = (pads[t], runs[-1][1] + 1)
        else:
            runs.append((pads[t], 1))
    return runs


def _rng(seed: int, sample: Sequence[Media], k: int, what: str) -> torch.Generator:
    return rng(seed, [(m.modality, m.size) for m in sample], k, what)


def _count(media: Media) -> int:
    if media.modality == "audio":
        return audio_tokens(media.size[0])
    thw = (1, *media.size) if media.modality == "image" else tuple(media.size)
    return math.prod(thw) // MERGE**2


def _region(model, media: Media, fps: float) -> tuple[list[int], list[tuple[str, int]]]:
    """One item's ids, markers included, and its runs (``Media.tokens`` applied)."""
    cfg = model.config
    if media.modality == "video" and len(media.size) == 4:  # audio in video
        *grid, frames = media.size
        runs = interleaved_runs(model, tuple(grid), frames, fps)
        if media.tokens is not None:  # fault injection: each run's length
            runs = [(m, n) for (m, _), n in zip(runs, media.tokens, strict=True)]
        pad = {"video": cfg.video_token_id, "audio": cfg.audio_token_id}
        body = [pad[m] for m, n in runs for _ in range(n)]
        inner = [cfg.audio_start_token_id, *body, AUDIO_END]
        return [VISION_START, *inner, VISION_END], runs
    pad = {"image": cfg.image_token_id, "video": cfg.video_token_id, "audio": cfg.audio_token_id}
    n = media.tokens if media.tokens is not None else _count(media)
    start, end = (
        (cfg.audio_start_token_id, AUDIO_END)
        if media.modality == "audio"
        else (VISION_START, VISION_END)
    )
    return [start, *[pad[media.modality]] * n, end], [(media.modality, n)]


def make_batch(
    model, samples, *, text_len: int = 6, swap=None, seed: int = 0, fps: float = FPS
) -> FamilyBatch:
    """A right-padded batch as ``Qwen3OmniMoeProcessor`` lays it out.

    ``size``: image ``(h, w)`` patch grid (16-px patches, both even); video ``(t, h, w)`` with t
    temporal patches of 2 frames; a video with its audio track (audio in video) ``(t, h, w, L)``;
    audio ``(L,)`` mel frames. ``Media.tokens`` sets the run's placeholders (audio in video:
    a tuple, each run's). ``fps``: the videos' ``video_second_per_grid`` is 2 / fps. With an
    audio-in-video item the batch passes ``use_audio_in_video=True``. Consumption order
    (``items``, ``swap`` indices): every audio clip, a video's track included (sample-major,
    prompt order), then every image, then every video. ``items`` are the feature side as
    passed to the model (per model-level item: a clip, an image, a video): after a swap, item
    i's entry is the swapped-in item's (its sample, its count); ``runs`` are the token side.
    """
    rows, runs = [], []
    data = {m: [] for m in ORDER}  # per item: (owner sample, pixels or mel, grid or length)
    for si, sample in enumerate(samples):
        ids = torch.randint(
            1000, 100000, (text_len,), generator=_rng(seed, sample, -1, "text")
        ).tolist()
        sruns = []
        for k, media in enumerate(sample):
            if media.modality not in ORDER:
                raise ValueError(f"qwen3_omni has no {media.modality!r} modality")
            region, mruns = _region(model, media, fps)
            ids += region
            ids += torch.randint(
                1000, 100000, (2,), generator=_rng(seed, sample, k, "gap")
            ).tolist()
            sruns += mruns
            g = _rng(seed, sample, k, "data")
            if media.modality == "audio" or len(media.size) == 4:
                length = media.size[-1]
                data["audio"].append((si, torch.randn(MEL_BINS, length, generator=g), length))
            if media.modality != "audio":
                thw = (1, *media.size) if media.modality == "image" else tuple(media.size[:3])
                data[media.modality].append(
                    (si, torch.randn(math.prod(thw), PATCH_DIM, generator=g), thw)
                )
        rows.append(ids)
        runs.append(sruns)
    order = [(m, i) for m in ORDER for i in range(len(data[m]))]
    if swap is not None:
        (ma, ia), (mb, ib) = order[swap[0]], order[swap[1]]
        if ma != mb:
            raise ValueError("swap exchanges two items of one modality")
        d = data[ma]
        d[ia], d[ib] = d[ib], d[ia]
    input_ids, attention_mask = right_pad(rows, PAD_ID)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if data["audio"]:
        lmax = max(length for _, _, length in data["audio"])
        feats = torch.zeros(len(data["audio"]), MEL_BINS, lmax)
        fmask = torch.zeros(len(data["audio"]), lmax, dtype=torch.int32)
        for a, (_, mel, length) in enumerate(data["audio"]):
            feats[a, :, :length] = mel
            fmask[a, :length] = 1
        kwargs["input_features"] = feats
        kwargs["feature_attention_mask"] = fmask
    for m, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if data[m]:
            kwargs[key] = torch.cat([x for _, x, _ in data[m]])
            kwargs[f"{m}_grid_thw"] = torch.tensor([g for _, _, g in data[m]], dtype=torch.long)
    if data["video"]:
        kwargs["video_second_per_grid"] = torch.full((len(data["video"]),), TEMPORAL_PATCH / fps)
    if any(m.modality == "video" and len(m.size) == 4 for sample in samples for m in sample):
        kwargs["use_audio_in_video"] = True
    items = []
    for m, i in order:
        owner, _, g = data[m][i]
        count = audio_tokens(g) if m == "audio" else math.prod(g) // MERGE**2
        items.append((owner, m, count))
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])
