"""Kimi K2.5 (transformers ``Kimi_K25ForConditionalGeneration``), tiny and random.

Grammar (``Kimi_K25Processor`` + chat template): an image is ``<|media_begin|>`` "image"
``<|media_content|>`` ``<|media_pad|>``×(h·w/4) ``<|media_end|>``; a video is, per chunk of at most
4 frames, the chunk's ``HH:MM:SS.mmm`` timestamp text, ``<|media_begin|>`` "video"
``<|media_content|>`` ``<|kimi_k25_video_placeholder|>``×(h·w/4) ``<|media_end|>`` (frames of a
chunk are mean-pooled: one ``video_grid_thw`` row per chunk). ``media_begin`` / ``media_end`` and
both placeholders come from the config (``vision_start_token_id``, ``vision_end_token_id``,
``image_token_id``, ``video_token_id``); ``<|media_content|>`` and the words / timestamps are
tokenizer-only: stand-ins ``MEDIA_CONTENT`` (163603), ``WORD_IMAGE``, ``WORD_VIDEO``, ``TIMESTAMP_ID``.
The image / video processors import torchvision (absent): pixels are random
``[Σ t·h·w, 3, 14, 14]`` float32 patches (row-major per frame, frames in order), as their
``patchify`` writes, and counts follow their arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "kimi_k25"

PATCH = 14
MERGE = 2
CHUNK_FRAMES = 4  # the video processor's temporal_patch_size
MEDIA_CONTENT = 163603  # tokenizer-only <|media_content|>
WORD_IMAGE, WORD_VIDEO = 1000, 1001  # stand-ins for the words "image" / "video"
TIMESTAMP_ID = 1100  # stand-in for a chunk's timestamp text
PAD_ID = 0
ORDER = ("image", "video")


def tiny_model(seed: int = 0, **overrides):
    """Tiny random ``Kimi_K25ForConditionalGeneration`` (vision 1 layer, hidden 32; text a 1-layer
    DeepSeek-V3 of hidden 32, vocab 163842; default ids)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(
        model_type="deepseek_v3",
        vocab_size=163842,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    vision = dict(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        pos_emb_height=8,
        pos_emb_width=8,
    )
    cfg = Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=32, **overrides
    )
    torch.manual_seed(seed)
    return Kimi_K25ForConditionalGeneration(cfg).eval().float()


def _rng(seed: int, sample: Sequence[Media], k: int, what: str) -> torch.Generator:
    return rng(seed, [(m.modality, m.size) for m in sample], k, what)


def _grids(media: Media) -> list[tuple[int, int, int]]:
    """``*_grid_thw`` rows of one item: an image (1, h, w); a video of f frames ⌈f/4⌉ chunks."""
    if media.modality == "image":
        return [(1, *media.size)]
    if media.modality == "video":
        f, h, w = media.size
        return [(min(CHUNK_FRAMES, f - c), h, w) for c in range(0, f, CHUNK_FRAMES)]
    raise ValueError(f"kimi_k25 has no {media.modality!r} modality")


def make_batch(model, samples, *, text_len: int = 6, swap=None, seed: int = 0) -> FamilyBatch:
    """A right-padded batch as ``Kimi_K25Processor`` lays it out.

    ``size``: image ``(h, w)`` patch grid (14-px patches, both even; tokens h·w/4); video
    ``(frames, h, w)``: ⌈frames/4⌉ chunks, each a run of h·w/4 (the last chunk may hold fewer frames).
    ``Media.tokens`` sets the item's total placeholders; for a video the difference lands on its
    last chunk. Consumption order (``items``, ``swap`` indices): every image, then every video
    (sample-major, prompt order); one item per image / video (its chunks together). ``items`` are
    the feature side as passed to the model: after a swap, item i's entry is the swapped-in item's
    (its sample, its count); ``runs`` are the token side (one per chunk).
    """
    cfg = model.config
    pads = {"image": cfg.image_token_id, "video": cfg.video_token_id}
    words = {"image": WORD_IMAGE, "video": WORD_VIDEO}
    rows, runs = [], []
    data = {m: [] for m in ORDER}
    for si, sample in enumerate(samples):
        ids = torch.randint(
            2000, 100000, (text_len,), generator=_rng(seed, sample, -1, "text")
        ).tolist()
        sruns = []
        for k, media in enumerate(sample):
            grids = _grids(media)
            per = [h * w // MERGE**2 for _, h, w in grids]
            if media.tokens is not None:
                per[-1] += media.tokens - sum(per)
                if per[-1] < 0:
                    raise ValueError(f"tokens={media.tokens} leaves a negative last run")
            for c, n in enumerate(per):
                if media.modality == "video":
                    ids.append(TIMESTAMP_ID + c)
                ids += [cfg.vision_start_token_id, words[media.modality], MEDIA_CONTENT]
                ids += [pads[media.modality]] * n + [cfg.vision_end_token_id]
                sruns.append((media.modality, n))
            ids += torch.randint(
                2000, 100000, (2,), generator=_rng(seed, sample, k, "gap")
            ).tolist()
            n_patch = sum(math.prod(g) for g in grids)
            pix = torch.randn(n_patch, 3, PATCH, PATCH, generator=_rng(seed, sample, k, "pix"))
            data[media.modality].append((si, pix, grids))
        rows.append(ids)
        runs.append(sruns)
    order = [(m, i) for m in ORDER for i in range(len(data[m]))]
    if swap is not None:
        (ma, ia), (mb, ib) = order[swap[0]], order[swap[1]]
        if ma != mb:
            raise ValueError("swap exchanges two items of one modality")
        data[ma][ia], data[ma][ib] = data[ma][ib], data[ma][ia]
    input_ids, attention_mask = right_pad(rows, PAD_ID)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    for m, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if data[m]:
            kwargs[key] = torch.cat([x for _, x, _ in data[m]])
            kwargs[f"{m}_grid_thw"] = torch.tensor(
                [g for _, _, gs in data[m] for g in gs], dtype=torch.long
            )
    items = [
        (data[m][i][0], m, sum(h * w // MERGE**2 for _, h, w in data[m][i][2])) for m, i in order
    ]
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])
