"""InternVL (transformers ``InternVLForConditionalGeneration``): a tiny random model and batches
laid out as ``InternVLProcessor`` lays them out.

- image ``size=(H, W)`` pixels: transformers' real ``GotOcr2ImageProcessorPil`` (runs on CPU;
  ``crop_to_patches`` with ``min_patches`` 1, ``max_patches`` ``MAX_TILES``, thumbnail) cuts it
  into ``tiles`` tiles of ``S x S``; run ``<img>`` ``<IMG_CONTEXT>``x(``SEQ`` * tiles) ``</img>``.
  The tile count (``num_patches``) is popped by the processor: it never reaches the model.
- video ``size=(frames,)``: ``frames`` tiles of ``S x S`` (the video processor, which needs
  torchvision, resizes each frame to one tile; the frames here are drawn at that size); one run
  per frame, ``"Frame{i}: <img>" <IMG_CONTEXT>xSEQ "</img>"``, joined by "\\n".
- ``pixel_values`` ``[total tiles, 3, S, S]``: images' and videos' tiles merged in prompt
  order (the processor's ``image_video_patches``), so items are consumed in token order across
  the batch, images and videos interleaved.

No tokenizer runs offline: ``<IMG_CONTEXT>`` is ``config.image_token_id``; ``<img>`` / ``</img>``
are the InternVL3 tokenizer's ids (``IMG_START``, ``IMG_END``); text is random ids, fixed
strings one id per character. ``Media.tokens`` for a video is its total, the difference put
on its last frame's run. ``FamilyBatch.items`` counts are ``SEQ`` x tiles.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing.families.base import FamilyBatch, Media, right_pad

FAMILY = "internvl"

IMG_START, IMG_END, IMAGE = 151665, 151666, 151667  # <img>, </img>, <IMG_CONTEXT>
PAD = 151643  # <|endoftext|>
TEXT_LO, TEXT_HI, CHAR_LO = 100, 1000, 1000
TILE, PATCH = 56, 14  # 4x4 patches, pixel shuffle 0.5 -> 2x2 = 4 tokens per tile
SEQ = 4  # config.image_seq_length
MAX_TILES = 6


def tiny_config(**overrides: Any):
    """Vision depth 1 (hidden 32, 56 px tiles, patch 14), Qwen2 text 2 layers (hidden 32),
    ``image_seq_length`` 4; default token id and vocabulary (151936)."""
    from transformers import InternVLConfig

    kwargs: dict[str, Any] = dict(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=[TILE, TILE],
            patch_size=[PATCH, PATCH],
        ),
        text_config=dict(
            model_type="qwen2",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        image_seq_length=SEQ,
    )
    kwargs.update(overrides)
    return InternVLConfig(**kwargs)


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(seed)
    return InternVLForConditionalGeneration(tiny_config(**overrides)).float().eval()


def image_processor():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE},
        crop_to_patches=True,
        min_patches=1,
        max_patches=MAX_TILES,
    )


def char_ids(text: str) -> list[int]:
    return [CHAR_LO + ord(c) - 32 for c in text]


def make_batch(
    model,
    samples: Sequence[Sequence[Media]],
    *,
    text_len: int = 6,
    swap: tuple[int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """Ids and ``pixel_values`` of ``samples`` (module docstring); swap exchanges two items'
    tile blocks (and so their counts)."""
    from PIL import Image

    del model
    proc = image_processor()
    rows, runs, found = [], [], []
    for s, sample in enumerate(samples):
        key = zlib.crc32(repr((seed, [(m.modality, tuple(m.size)) for m in sample])).encode())
        rng = np.random.default_rng(key)
        g = torch.Generator().manual_seed(key)
        row, sruns = rng.integers(TEXT_LO, TEXT_HI, size=text_len).tolist(), []
        for m in sample:
            if m.modality == "image":
                h, w = m.size
                base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
                img = Image.fromarray(base).resize((w, h), resample=Image.BICUBIC)
                tiles = proc(images=[img], return_tensors="pt")["pixel_values"]
                n = SEQ * tiles.shape[0]
                k = n if m.tokens is None else m.tokens
                row += [IMG_START, *[IMAGE] * k, IMG_END]
                sruns.append(("image", k))
            elif m.modality == "video":
                (frames,) = m.size
                tiles = torch.randn(frames, 3, TILE, TILE, generator=g)
                n = SEQ * frames
                k = n if m.tokens is None else m.tokens
                for f in range(frames):
                    r = SEQ + (k - n if f == frames - 1 else 0)
                    row += [*(char_ids("\n") if f else []), *char_ids(f"Frame{f + 1}: ")]
                    row += [IMG_START, *[IMAGE] * r, IMG_END]
                    sruns.append(("video", r))
            else:
                raise MediaInputError(f"{FAMILY} has no {m.modality!r} inputs")
            found.append((s, m.modality, tiles))
            row += rng.integers(TEXT_LO, TEXT_HI, size=text_len).tolist()
        rows.append(row)
        runs.append(sruns)
    blocks = [t for _, _, t in found]
    if swap is not None:
        a, b = swap
        blocks[a], blocks[b] = blocks[b], blocks[a]
    ids, attn = right_pad(rows, PAD)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": attn}
    if blocks:
        kwargs["pixel_values"] = torch.cat(blocks)
    items = [(s, mod, SEQ * t.shape[0]) for (s, mod, _), t in zip(found, blocks, strict=True)]
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])


def plain_logits(model, batch: FamilyBatch) -> torch.Tensor:
    """``model(**batch.kwargs).logits`` under no_grad (152k vocabulary: prefer
    :func:`plain_hidden` for comparisons)."""
    with torch.no_grad():
        return model(**batch.kwargs).logits


def plain_hidden(model, batch: FamilyBatch) -> torch.Tensor:
    """Final-norm hidden states of the same forward (``lm_head`` of these are the logits)."""
    with torch.no_grad():
        return model.model(**batch.kwargs).last_hidden_state
