"""Mistral 3 / Pixtral (transformers ``Mistral3ForConditionalGeneration``): tiny model and batches.

Grammar (``PixtralProcessor.replace_image_token``): an image of processed size ``(H, W)`` is
``rows = H // p`` rows of ``cols = W // p`` ``[IMG]`` each followed by ``[IMG_BREAK]``, the last
break replaced by ``[IMG_END]`` (``p = patch_size * spatial_merge_size`` = 14 * 2 = 28). Breaks
and the end marker get no feature: the image has ``rows * cols`` features.

The config knows only ``image_token_id`` (10, alias of ``image_token_index``); the break and end
ids are the Mistral (tekken) tokenizer's ``[IMG_BREAK]`` = 12, ``[IMG_END]`` = 13, ``<pad>`` = 11,
``<s>`` = 1. ``PixtralProcessor`` itself needs torchvision (absent here), so the ids are built from
its arithmetic above; its Pillow image processor (``PixtralImageProcessorPil``) does run, and
``tests/test_family_mistral3.py`` checks :func:`resized_size` and the pixel layout against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "mistral3"

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
BOS_ID, PAD_ID, BREAK_ID, END_ID = 1, 11, 12, 13
TEXT_IDS = (20, 64)  # text ids are drawn from [20, 64): clear of every special id above
LONGEST_EDGE = 1540  # Mistral-Small-3.1's preprocessor ``size``; the class default is 1024


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random 1-layer Pixtral tower (hidden 32, patch 14, rope table for 224 px) and a 1-layer
    Mistral LM (hidden 32, vocab 64), float32, eval. ``overrides``: top-level ``Mistral3Config``
    fields; ``vision_config`` / ``text_config`` dicts are merged into the tiny defaults."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, patch_size=14, image_size=224,
    )  # fmt: skip
    text = dict(
        model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=TEXT_IDS[1],
        pad_token_id=PAD_ID,
    )  # fmt: skip
    vision.update(overrides.pop("vision_config", {}))
    text.update(overrides.pop("text_config", {}))
    config = Mistral3Config(vision_config=vision, text_config=text, **overrides)
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config).eval().float()


def merge_patch(model: torch.nn.Module) -> int:
    """Pixels per feature side: ``vision_config.patch_size * spatial_merge_size`` (28)."""
    return model.config.vision_config.patch_size * model.config.spatial_merge_size


def resized_size(
    height: int, width: int, longest_edge: int = LONGEST_EDGE, patch: int = 28
) -> tuple[int, int]:
    """``PixtralImageProcessor``'s resize of an ``height x width`` image (its
    ``get_resize_output_image_size``): ``ratio = max(height / longest_edge, width / longest_edge)``;
    if ``ratio > 1`` both sides become ``floor(side / ratio)`` (float64); then each side is rounded
    UP to a multiple of ``patch`` (``((side - 1) // patch + 1) * patch``) — small images grow."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


def num_features(height: int, width: int, patch: int = 28) -> int:
    """Features of a processed image (``image_sizes`` row ``(height, width)``):
    ``(height // patch) * (width // patch)`` (``Mistral3Model.get_image_features``' split)."""
    return (height // patch) * (width // patch)


def image_run(n_image: int, cols: int, image_id: int) -> list[int]:
    """``n_image`` ``[IMG]`` written in rows of ``cols``, ``[IMG_BREAK]`` after each row, the last
    break ``[IMG_END]`` (aligned: ``n_image = rows * cols``; a fault's partial last row is kept)."""
    if n_image == 0:
        return []
    rows = -(-n_image // cols)
    ids: list[int] = []
    for r in range(rows):
        ids += [image_id] * min(cols, n_image - r * cols) + [BREAK_ID]
    ids[-1] = END_ID
    return ids


def _text(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(*TEXT_IDS, (n,), generator=gen).tolist()


def make_batch(
    model: torch.nn.Module,
    samples: Sequence[Sequence[Media]],
    *,
    text_len: int = 6,
    swap: tuple[int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """``Media("image", (H, W))``: the PROCESSED pixel size (an ``image_sizes`` row), each side a
    multiple of :func:`merge_patch` (use :func:`resized_size` for an original size).

    Row of a sample: ``<s>``, ``text_len`` text ids, then per image its run and ``text_len``
    text ids. ``pixel_values`` ``[n, 3, maxH, maxW]`` float32, each image top-left, zero-padded
    (the processor pads after normalising); ``image_sizes`` ``[n, 2]`` int64 ``(H, W)``; both in
    token order over the batch (the model's consumption order). An item's pixels and the text ids
    depend only on ``seed``, its sample's media and its place in the sample, so a sample alone in
    a batch gets the same ones. ``swap=(i, j)`` exchanges pixels and ``image_sizes`` of items
    ``i``, ``j``; ``items`` then describe the kwargs (item ``i`` has ``j``'s count), ``runs`` the ids.
    Omits ``pixel_values`` / ``image_sizes`` when there is no image.
    """
    p, image_id = merge_patch(model), model.config.image_token_id
    rows: list[list[int]] = []
    runs: list[list[tuple[str, int]]] = []
    pixels: list[torch.Tensor] = []
    sizes: list[tuple[int, int]] = []
    items: list[tuple[int, str, int]] = []
    for s, sample in enumerate(samples):
        key = tuple((m.modality, m.size) for m in sample)
        gen = rng(seed, key)
        row, sample_runs = [BOS_ID, *_text(gen, text_len)], []
        for k, media in enumerate(sample):
            if media.modality != "image" or len(media.size) != 2:
                raise ValueError(f"mistral3 takes Media('image', (H, W)), got {media}")
            h, w = media.size
            if h <= 0 or w <= 0 or h % p or w % p:
                raise ValueError(f"image size {media.size} is not a positive multiple of {p}")
            n = num_features(h, w, p)
            n_ids = n if media.tokens is None else media.tokens
            row += image_run(n_ids, w // p, image_id) + _text(gen, text_len)
            sample_runs.append(("image", n_ids))
            pixels.append(torch.randn((3, h, w), generator=rng(seed, key, k)))
            sizes.append((h, w))
            items.append((s, "image", n))
        rows.append(row)
        runs.append(sample_runs)
    if swap is not None:
        i, j = swap
        for seq in (pixels, sizes):
            seq[i], seq[j] = seq[j], seq[i]
        items[i], items[j] = (
            (items[i][0], "image", items[j][2]),
            (items[j][0], "image", items[i][2]),
        )
    ids, mask = right_pad(rows, PAD_ID)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if pixels:
        hmax, wmax = max(h for h, _ in sizes), max(w for _, w in sizes)
        pv = torch.zeros((len(pixels), 3, hmax, wmax))
        for n, x in enumerate(pixels):
            pv[n, :, : x.shape[1], : x.shape[2]] = x
        kwargs["pixel_values"] = pv
        kwargs["image_sizes"] = torch.tensor(sizes, dtype=torch.long)
    return FamilyBatch(kwargs, items, runs, [len(r) for r in rows])
