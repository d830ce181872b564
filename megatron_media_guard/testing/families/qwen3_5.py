"""Qwen3.5 (transformers ``Qwen3_5ForConditionalGeneration``): a tiny random model and batches
laid out as the Qwen3-VL processor (which Qwen3.5 checkpoints use) lays them out.

- image ``size=(H, W)`` pixels: ``pixel_values`` / ``image_grid_thw`` come from transformers'
  real ``Qwen2VLImageProcessorPil`` (patch 16, merge 2, ``max_pixels`` = ``MAX_PIXELS``), via
  :func:`megatron_media_guard.testing.qwen_vl.image_inputs`; run ``<|vision_start|>``
  ``<|image_pad|>``x(t*h*w/4) ``<|vision_end|>``.
- video ``size=(frames, H, W)`` pixels: the video processor needs torchvision, so the patches
  come from :func:`megatron_media_guard.testing.qwen_vl.video_patches` (its restated
  resize-and-patchify); one run per temporal group: the processor's ``"<{t:.1f} seconds>"``
  text (``Qwen3VLProcessor._calculate_timestamps`` at ``FPS``, one id per character) then
  ``<|vision_start|>`` ``<|video_pad|>``x(h*w/4) ``<|vision_end|>``. ``Media.tokens`` for a
  video is its total over all runs, the difference put on its last run.
- ``mm_token_type_ids`` int64: 1 on image pads, 2 on video pads, as the processor's
  ``create_mm_token_type_ids`` writes them.

No tokenizer runs offline: text ids are random in ``[TEXT_LO, TEXT_HI)``, timestamp characters
map to ``CHAR_LO + ord(c) - 32``; the grammar ids are the config defaults. Items are consumed
images first (batch order), then videos. Pixel content is smooth (low-frequency) noise keyed
by the sample's media, so a sample alone and in a batch gets the same pixels and text.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing import qwen_vl
from megatron_media_guard.testing.families.base import FamilyBatch, Media, right_pad

FAMILY = "qwen3_5"

VISION_START, VISION_END, IMAGE, VIDEO = 248053, 248054, 248056, 248057
PAD = 248044  # <|endoftext|> in the Qwen3.5 tokenizer
TEXT_LO, TEXT_HI, CHAR_LO = 100, 1000, 1000
VOCAB = 248064
PATCH, MERGE = 16, 2
MAX_PIXELS = 128 * 128
FPS = 2.0


def tiny_config(**overrides: Any):
    """Text 2 layers (gated delta net + full attention, hidden 32, interleaved M-RoPE 1/1/2),
    vision depth 1 (hidden 32), tied embeddings; default token ids and a vocabulary that holds
    them."""
    from transformers import Qwen3_5Config

    kwargs: dict[str, Any] = dict(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [1, 1, 2],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.5,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            num_position_embeddings=64,
        ),
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return Qwen3_5Config(**kwargs)


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen3_5ForConditionalGeneration(tiny_config(**overrides)).float().eval()


def timestamps(frames: int) -> list[float]:
    """One timestamp per temporal group, from the processor's own ``_calculate_timestamps``."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return Qwen3VLProcessor._calculate_timestamps(None, list(range(frames)), FPS, 2)


def char_ids(text: str) -> list[int]:
    return [CHAR_LO + ord(c) - 32 for c in text]


def _sample_seed(sample: Sequence[Media], seed: int) -> int:
    return zlib.crc32(repr((seed, [(m.modality, tuple(m.size)) for m in sample])).encode())


def make_batch(
    model,
    samples: Sequence[Sequence[Media]],
    *,
    text_len: int = 6,
    swap: tuple[int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """Ids, pixels, grids and ``mm_token_type_ids`` of ``samples`` (module docstring)."""
    del model  # counts come from the processor, not the model
    rows, runs = [], []
    found: dict[str, list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]]] = {
        "image": [],
        "video": [],
    }
    for s, sample in enumerate(samples):
        key = _sample_seed(sample, seed)
        rng = np.random.default_rng(key)
        row, sruns = list(rng.integers(TEXT_LO, TEXT_HI, size=text_len)), []
        for i, m in enumerate(sample):
            if m.modality == "image":
                pv, grid = qwen_vl.image_inputs(
                    [qwen_vl.smooth_image(*m.size, seed=key % 10_000 + i)], PATCH, MAX_PIXELS
                )
                n = int(grid.prod()) // MERGE**2
                k = n if m.tokens is None else m.tokens
                row += [VISION_START, *[IMAGE] * k, VISION_END]
                sruns.append(("image", k))
                found["image"].append((s, n, (pv, grid)))
            elif m.modality == "video":
                frames, h, w = m.size
                clip = qwen_vl.smooth_clip(frames, h, w, seed=key % 10_000 + i)
                pv, grid = qwen_vl.video_patches(clip, PATCH, MAX_PIXELS)
                t, per = int(grid[0, 0]), int(grid[0, 1:].prod()) // MERGE**2
                n = t * per
                k = n if m.tokens is None else m.tokens
                for g, ts in enumerate(timestamps(frames)):
                    r = per + (k - n if g == t - 1 else 0)
                    row += [
                        *char_ids(f"<{ts:.1f} seconds>"),
                        VISION_START,
                        *[VIDEO] * r,
                        VISION_END,
                    ]
                    sruns.append(("video", r))
                found["video"].append((s, n, (pv, grid)))
            else:
                raise MediaInputError(f"{FAMILY} has no {m.modality!r} inputs")
            row += list(rng.integers(TEXT_LO, TEXT_HI, size=text_len))
        rows.append([int(x) for x in row])
        runs.append(sruns)

    order = [(mod, i) for mod in ("image", "video") for i in range(len(found[mod]))]
    payload = {mod: [p for _, _, p in found[mod]] for mod in found}
    if swap is not None:
        (ma, a), (mb, b) = order[swap[0]], order[swap[1]]
        if ma != mb:
            raise MediaInputError(f"swap {swap}: items of different modality ({ma}, {mb})")
        payload[ma][a], payload[ma][b] = payload[ma][b], payload[ma][a]
    # items: the run's sample, the count its (possibly swapped) metadata gives
    items = [
        (found[mod][i][0], mod, int(payload[mod][i][1].prod()) // MERGE**2) for mod, i in order
    ]

    ids, attn = right_pad(rows, PAD)
    types = torch.zeros_like(ids)
    types[ids == IMAGE] = 1
    types[ids == VIDEO] = 2
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": attn, "mm_token_type_ids": types}
    if payload["image"]:
        kwargs["pixel_values"] = torch.cat([p for p, _ in payload["image"]])
        kwargs["image_grid_thw"] = torch.cat([g for _, g in payload["image"]])
    if payload["video"]:
        kwargs["pixel_values_videos"] = torch.cat([p for p, _ in payload["video"]])
        kwargs["video_grid_thw"] = torch.cat([g for _, g in payload["video"]])
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])


def plain_logits(model, batch: FamilyBatch) -> torch.Tensor:
    """``model(**batch.kwargs).logits`` under no_grad. Over the 248k vocabulary these cost ~6x the
    rest of the tiny forward on CPU: compare :func:`plain_hidden` where logits are not needed."""
    with torch.no_grad():
        return model(**batch.kwargs).logits


def plain_hidden(model, batch: FamilyBatch) -> torch.Tensor:
    """The final-norm hidden states ``model.model(**kwargs).last_hidden_state`` (the logits are
    ``lm_head`` of these): the same forward, merge and rope index, without the vocabulary."""
    with torch.no_grad():
        return model.model(**batch.kwargs).last_hidden_state
