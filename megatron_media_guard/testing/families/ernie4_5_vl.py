"""Ernie 4.5 VL (transformers ``Ernie4_5_VLMoeForConditionalGeneration``), tiny and random.

Grammar (``Ernie4_5_VLMoeProcessor`` + chat template): an image is ``<|IMAGE_START|>``
``<|IMAGE_PLACEHOLDER|>``×(h·w/4) ``<|IMAGE_END|>``; a video is ``<|VIDEO_START|>``
``<|VIDEO_PLACEHOLDER|>``×(t·h·w/8) ``<|VIDEO_END|>`` (ONE run per video; frames merged in pairs by
the resampler, ``temporal_merge_size`` 2). Every id comes from the config. ``mm_token_type_ids``
marks placeholders (1 image, 2 video), ``moe_mm_token_type_ids`` also the start/end markers (the
text/vision expert routing). No tokenizer is loaded: text is random ids below the special ids
(``SMALL_TEXT_IDS``). Pixels are
random ``[Σ patches, 3·14·14]`` float32 rows (temporal patch 1: one row per patch per frame).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import SMALL_SPECIAL_IDS as SPECIAL_IDS
from .base import SMALL_TEXT_IDS as TEXT_IDS
from .base import SMALL_VOCAB as VOCAB
from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "ernie4_5_vl"

PATCH = 14
MERGE = 2
TEMPORAL_MERGE = 2
PATCH_DIM = 3 * PATCH * PATCH
PAD_ID = 0
ORDER = ("image", "video")


def tiny_model(seed: int = 0, **overrides):
    """Tiny random ``Ernie4_5_VLMoeForConditionalGeneration`` (vision depth 1, hidden 32; text: one
    dense and one sparse layer with 4 text + 4 vision experts; vocab
    ``SMALL_VOCAB`` of ``testing/families/base``, not the real 103424 rows)."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    text = dict(
        vocab_size=VOCAB,
        pad_token_id=PAD_ID,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=[32, 32],
        moe_k=2,
        moe_num_experts=4,
        moe_num_shared_experts=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
    cfg = Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=vision, **{**SPECIAL_IDS, **overrides}
    )
    torch.manual_seed(seed)
    return Ernie4_5_VLMoeForConditionalGeneration(cfg).eval().float()


def smart_resize(
    height: int, width: int, *, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 6177
):
    """``Ernie4_5_VLMoeImageProcessor``'s resize target ``(H, W)`` (factor 28, ``size``
    shortest/longest edge = min/max pixels)."""
    factor = PATCH * MERGE
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int) -> tuple[int, int, int]:
    """``image_grid_thw`` row for an image of ``height × width`` pixels; tokens = h·w/4."""
    rh, rw = smart_resize(height, width)
    return 1, rh // PATCH, rw // PATCH


def _rng(seed: int, sample: Sequence[Media], k: int, what: str) -> torch.Generator:
    return rng(seed, [(m.modality, m.size) for m in sample], k, what)


def _grid(media: Media) -> tuple[int, int, int]:
    if media.modality == "image":
        return (1, *media.size)
    if media.modality == "video":
        if media.size[0] % TEMPORAL_MERGE:
            raise ValueError(
                "an Ernie video has an even frame count (the resampler drops an odd last frame)"
            )
        return tuple(media.size)
    raise ValueError(f"ernie4_5_vl has no {media.modality!r} modality")


def count(modality: str, thw: Sequence[int]) -> int:
    """Feature rows of one item: image t·h·w/4, video t·h·w/8."""
    return math.prod(thw) // MERGE**2 // (TEMPORAL_MERGE if modality == "video" else 1)


def make_batch(model, samples, *, text_len: int = 6, swap=None, seed: int = 0) -> FamilyBatch:
    """A right-padded batch as ``Ernie4_5_VLMoeProcessor`` lays it out.

    ``size``: image ``(h, w)`` patch grid (14-px patches, both even; tokens h·w/4); video
    ``(t, h, w)``: t frames (even), tokens t·h·w/8. ``Media.tokens`` sets the run's placeholders.
    Consumption order (``items``, ``swap`` indices): every image (sample-major, prompt order), then
    every video. ``items`` are the feature side as passed to the model: after a swap, item i's entry
    is the swapped-in item's (its sample, its count); ``runs`` are the token side.
    """
    cfg = model.config
    marks = {
        "image": (cfg.image_start_token_id, cfg.image_token_id, cfg.image_end_token_id, 1),
        "video": (cfg.video_start_token_id, cfg.video_token_id, cfg.video_end_token_id, 2),
    }
    rows, types, moe_types, runs = [], [], [], []
    data = {m: [] for m in ORDER}
    for si, sample in enumerate(samples):
        ids = torch.randint(
            *TEXT_IDS, (text_len,), generator=_rng(seed, sample, -1, "text")
        ).tolist()
        tt, mt, sruns = [0] * text_len, [0] * text_len, []
        for k, media in enumerate(sample):
            thw = _grid(media)
            start, pad, end, code = marks[media.modality]
            n = media.tokens if media.tokens is not None else count(media.modality, thw)
            ids += [start] + [pad] * n + [end]
            tt += [0] + [code] * n + [0]
            mt += [code] * (n + 2)
            ids += torch.randint(*TEXT_IDS, (2,), generator=_rng(seed, sample, k, "gap")).tolist()
            tt += [0, 0]
            mt += [0, 0]
            sruns.append((media.modality, n))
            pix = torch.randn(math.prod(thw), PATCH_DIM, generator=_rng(seed, sample, k, "pix"))
            data[media.modality].append((si, pix, thw))
        rows.append(ids)
        types.append(tt)
        moe_types.append(mt)
        runs.append(sruns)
    order = [(m, i) for m in ORDER for i in range(len(data[m]))]
    if swap is not None:
        (ma, ia), (mb, ib) = order[swap[0]], order[swap[1]]
        if ma != mb:
            raise ValueError("swap exchanges two items of one modality")
        data[ma][ia], data[ma][ib] = data[ma][ib], data[ma][ia]
    input_ids, attention_mask = right_pad(rows, PAD_ID)
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": right_pad(types, 0)[0],
        "moe_mm_token_type_ids": right_pad(moe_types, 0)[0],
    }
    for m, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if data[m]:
            kwargs[key] = torch.cat([x for _, x, _ in data[m]])
            kwargs[f"{m}_grid_thw"] = torch.tensor([g for _, _, g in data[m]], dtype=torch.long)
    items = [(data[m][i][0], m, count(m, data[m][i][2])) for m, i in order]
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])
