"""Gemma 3 (transformers ``Gemma3ForConditionalGeneration``): a tiny random model and batches
laid out as ``Gemma3Processor`` lays them out.

- image ``size=(H, W)`` pixels: transformers' real ``Gemma3ImageProcessorPil`` (runs on CPU)
  resizes it to the tower's ``S x S`` (``IMAGE_SIZE``) and, with ``pan_and_scan=True``, adds its
  crops as extra images right after it (``num_crops`` never reaches the model). Each pixel row
  is one item of ``mm_tokens_per_image`` (``MM_TOKENS``) features.
- per pixel row the processor's ``full_image_sequence``: "\\n\\n" ``<start_of_image>``
  ``<image_soft_token>``xMM ``<end_of_image>`` "\\n\\n"; with crops "Here is the original image
  {full} and here are some crops to help you see better " + " ".join([full] * num_crops).
- ``token_type_ids`` int64: 1 on the soft tokens (the processor's ``mm_token_type_ids``, renamed).

No tokenizer runs offline: marker ids are the config defaults; text is random ids in
``[TEXT_LO, TEXT_HI)``, fixed strings one id per character (``CHAR_LO + ord(c) - 32``, "\\n\\n"
one id ``NL2``). ``Media.tokens`` sets the soft tokens of the original image's run (crops stay
aligned). Items are the pixel rows in order; swap exchanges two rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing.families.base import FamilyBatch, Media, right_pad

FAMILY = "gemma3"

BOI, EOI, IMAGE = 255_999, 256_000, 262_144  # config defaults
PAD, BOS = 0, 2
NL2 = 108  # stands for "\n\n"
TEXT_LO, TEXT_HI, CHAR_LO = 300, 1000, 1000
IMAGE_SIZE, PATCH, MM_TOKENS = 32, 8, 4  # 4x4 patches pooled 2x2 -> 4 tokens per image
CROP_MIN = 16  # pan_and_scan_min_crop_size, scaled down with the image size
INTRO = "Here is the original image "
OUTRO = " and here are some crops to help you see better "


def tiny_config(**overrides: Any):
    """Text 2 layers (sliding + full, hidden 32), SigLIP depth 1 (hidden 32, 32 px, patch 8),
    ``mm_tokens_per_image`` 4; default token ids and vocabulary (262208)."""
    from transformers import Gemma3Config

    kwargs: dict[str, Any] = dict(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=16,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
        ),
        mm_tokens_per_image=MM_TOKENS,
    )
    kwargs.update(overrides)
    return Gemma3Config(**kwargs)


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Eval, float32. The projector weight starts at zeros in transformers (features would all be
    0): it is drawn at unit scale here so every image feature counts."""
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_config(**overrides)).float().eval()
    w = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        w.normal_(0.0, w.shape[0] ** -0.5)
    return model


def image_processor(pan_and_scan: bool = False):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_pan_and_scan=pan_and_scan,
        pan_and_scan_min_crop_size=CROP_MIN,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )


def char_ids(text: str) -> list[int]:
    return [CHAR_LO + ord(c) - 32 for c in text]


def _full(k: int) -> list[int]:
    return [NL2, BOI, *[IMAGE] * k, EOI, NL2]


def make_batch(
    model,
    samples: Sequence[Sequence[Media]],
    *,
    text_len: int = 6,
    swap: tuple[int, int] | None = None,
    seed: int = 0,
    pan_and_scan: bool = False,
) -> FamilyBatch:
    """Ids, ``pixel_values`` ``[rows, 3, S, S]`` and ``token_type_ids`` (module docstring)."""
    from PIL import Image

    del model  # the count is fixed per pixel row
    proc = image_processor(pan_and_scan)
    rows, runs, pixels, owners = [], [], [], []
    for s, sample in enumerate(samples):
        key = zlib.crc32(repr((seed, [(m.modality, tuple(m.size)) for m in sample])).encode())
        rng = np.random.default_rng(key)
        row, sruns = [BOS, *rng.integers(TEXT_LO, TEXT_HI, size=text_len).tolist()], []
        for m in sample:
            if m.modality != "image":
                raise MediaInputError(f"{FAMILY} has no {m.modality!r} inputs")
            h, w = m.size
            base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            img = Image.fromarray(base).resize((w, h), resample=Image.BICUBIC)
            out = proc(images=[img], return_tensors="pt")
            crops = int(out["num_crops"][0])
            k = MM_TOKENS if m.tokens is None else m.tokens
            if crops:
                row += [*char_ids(INTRO), *_full(k), *char_ids(OUTRO)]
                for c in range(crops):
                    row += [*(char_ids(" ") if c else []), *_full(MM_TOKENS)]
            else:
                row += _full(k)
            sruns += [("image", k)] + [("image", MM_TOKENS)] * crops
            pixels += list(out["pixel_values"])
            owners += [s] * (1 + crops)
            row += rng.integers(TEXT_LO, TEXT_HI, size=text_len).tolist()
        rows.append(row)
        runs.append(sruns)
    if swap is not None:
        a, b = swap
        pixels[a], pixels[b] = pixels[b], pixels[a]
    ids, attn = right_pad(rows, PAD)
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": attn,
        "token_type_ids": (ids == IMAGE).long(),
    }
    if pixels:
        kwargs["pixel_values"] = torch.stack(pixels)
    items = [(s, "image", MM_TOKENS) for s in owners]
    return FamilyBatch(kwargs=kwargs, items=items, runs=runs, lengths=[len(r) for r in rows])


def plain_logits(model, batch: FamilyBatch) -> torch.Tensor:
    """``model(**batch.kwargs).logits`` under no_grad (262k vocabulary: prefer
    :func:`plain_hidden` for comparisons)."""
    with torch.no_grad():
        return model(**batch.kwargs).logits


def plain_hidden(model, batch: FamilyBatch) -> torch.Tensor:
    """Final-norm hidden states of the same forward (``lm_head`` of these are the logits)."""
    with torch.no_grad():
        return model.model(**batch.kwargs).last_hidden_state
