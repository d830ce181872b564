"""LLaVA-OneVision (transformers ``LlavaOnevisionForConditionalGeneration``): tiny model and batches.

Grammar (``LlavaOnevisionProcessor``): a bare run of ``<image>`` (``config.image_token_id``,
151646) x N per image and of ``<video>`` (``config.video_token_id``, 151647) x N per video; no
start/end markers. N per image: :func:`llava_onevision_num_features` (anyres grid from
``image_sizes``, unpadding, the ``anyres_max_k`` downscale, one newline feature per row, the base
tile; a sample with several images gets base + 1 per image, told by ``batch_num_images``); per
video ``frames * ceil(side / 2) ** 2 + 1``.

``LlavaOnevisionProcessor`` cannot be built here (its video-processor lookup needs torchvision),
so the ids are built from that arithmetic; ``tests/test_family_llava_onevision.py`` checks it
against the real ``LlavaOnevisionImageProcessorPil`` outputs fed to the processor's own
``replace_image_token`` / ``replace_video_token`` and to the model's own ``get_image_features``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ...geometry.anyres import best_resolution
from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "llava_onevision"

IMAGE_TOKEN, VIDEO_TOKEN = "<image>", "<video>"
PAD_ID = 151643  # Qwen2 ``<|endoftext|>``
TEXT_IDS = (100, 1000)
VOCAB = 151680
TILE = 56  # tiny vision image_size (the real one is 384): 4 x 4 patches of 14
PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 7) for j in range(1, 7)]  # the default, scaled


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random 1-layer SigLIP tower (hidden 32, image_size 56, patch 14: 4 x 4 features a tile),
    a 1-layer Qwen2 LM (hidden 32, vocab 151680), the default pinpoints scaled from 384 to 56
    (56 * {1..6} squared), ``anyres_max_9``, strategy "full"; float32, eval. ``overrides``:
    top-level ``LlavaOnevisionConfig`` fields; ``vision_config`` / ``text_config`` dicts merged."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, patch_size=14, image_size=TILE,
        vision_use_head=False,
    )  # fmt: skip
    text = dict(
        model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB, pad_token_id=PAD_ID,
    )  # fmt: skip
    vision.update(overrides.pop("vision_config", {}))
    text.update(overrides.pop("text_config", {}))
    overrides.setdefault("image_grid_pinpoints", PINPOINTS)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, **overrides)
    torch.manual_seed(seed)
    return LlavaOnevisionForConditionalGeneration(config).eval().float()


#: ``transformers.image_processing_utils.select_best_resolution`` as ``(height, width,
#: pinpoints)``: the repair geometry's own copy (tested against transformers' in
#: tests/test_family_llava_onevision.py)
select_best_resolution = best_resolution


def llava_onevision_num_features(
    orig_h: int, orig_w: int, config: Any, *, multi_image: bool = False
) -> int:
    """Features (= ``<image>`` placeholders) of one image of original size ``orig_h x orig_w``
    (its ``image_sizes`` row), as ``LlavaOnevisionModel.pack_image_features`` makes them and
    ``LlavaOnevisionProcessor._get_number_of_features`` counts them. Pure: reads
    ``config.vision_config.image_size`` / ``.patch_size``, ``config.image_grid_pinpoints``,
    ``config.vision_aspect_ratio``.

    ``side = image_size // patch_size``, ``base = side ** 2`` (the whole-image tile).
    ``multi_image`` (the image's sample has several images, ``batch_num_images[s] > 1``): the
    image is one tile, ``base + 1`` (one newline). Otherwise (anyres):
    1. ``(bh, bw) = select_best_resolution(orig, pinpoints)``; the grid of tiles is
       ``(bh // image_size, bw // image_size)``, its feature map ``(side * tiles_h, side * tiles_w)``;
    2. unpad (``unpad_image``): if ``orig_w / orig_h > cur_w / cur_h``,
       ``new_h = int(round(orig_h * (cur_w / orig_w), 7))`` and ``cur_h -= 2 * ((cur_h - new_h) // 2)``;
       else the same on the width;
    3. ``anyres_max_k``: ``ratio = sqrt(cur_h * cur_w / (k * side ** 2))``; if ``ratio > 1.1``,
       ``cur_h, cur_w = int(cur_h // ratio), int(cur_w // ratio)`` (bilinear downscale);
    4. one newline feature per row: ``base + cur_h * (cur_w + 1)``.
    Assumes the tower's feature grid is ``side x side`` (strategy "full" on SigLIP, as shipped;
    "default" on a CLS tower drops the CLS and gives the same grid).
    """
    side = config.vision_config.image_size // config.vision_config.patch_size
    base = side * side
    if multi_image:
        return base + 1
    tile = config.vision_config.image_size
    best_h, best_w = select_best_resolution(orig_h, orig_w, config.image_grid_pinpoints)
    cur_h, cur_w = side * (best_h // tile), side * (best_w // tile)
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(orig_w * (cur_h / orig_h), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    max_tiles = int(config.vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005 (as transformers)
    ratio = math.sqrt(cur_h * cur_w / (max_tiles * side**2))
    if ratio > 1.1:
        cur_h, cur_w = int(cur_h // ratio), int(cur_w // ratio)
    return base + cur_h * (cur_w + 1)


def num_tiles(orig_h: int, orig_w: int, config: Any, *, multi_image: bool = False) -> int:
    """Tiles of an image in ``pixel_values[n]`` that the model reads: 1 (multi-image) or
    ``(bh // image_size) * (bw // image_size) + 1`` (``image_size_to_num_patches``)."""
    if multi_image:
        return 1
    tile = config.vision_config.image_size
    best_h, best_w = select_best_resolution(orig_h, orig_w, config.image_grid_pinpoints)
    return (best_h // tile) * (best_w // tile) + 1


def video_num_features(frames: int, config: Any) -> int:
    """``frames * ceil(side / 2) ** 2 + 1`` (``apply_pooling``, one newline per video)."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    return frames * math.ceil(side / 2) ** 2 + 1


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
    """``Media("image", (H, W))``: the ORIGINAL image size (the ``image_sizes`` row; the
    processor resizes tiles to the tower's ``image_size``). ``Media("video", (frames,))``: frames
    of ``image_size`` squared; every video of a batch has the same frame count (the processor
    stacks them).

    Row of a sample: ``text_len`` text ids, then per item its bare run and ``text_len`` text ids.
    Image kwargs (in token order over the batch, the model's consumption order):
    ``pixel_values`` ``[n, max_tiles, 3, S, S]`` float32 (tile 0 the whole image, then the grid
    row-major, zero tiles after an image's own), ``image_sizes`` ``[n, 2]`` int64 ``(H, W)``,
    ``batch_num_images`` ``[samples with images]`` int64 (text-only and video-only samples are
    left out, as the image processor does). Video: ``pixel_values_videos`` ``[v, frames, 3, S, S]``.
    Images are merged before videos. An item's pixels and the text ids depend only on ``seed``, its
    sample's media and its place in the sample. ``swap=(i, j)`` (image items) exchanges the
    ``pixel_values`` and ``image_sizes`` rows; ``items`` then give what the model computes from the
    kwargs (the count of image ``j``'s size at position ``i``, with position ``i``'s multi-image
    flag), ``runs`` the ids.
    """
    cfg = model.config
    tile = cfg.vision_config.image_size
    ids_of = {"image": cfg.image_token_id, "video": cfg.video_token_id}
    rows: list[list[int]] = []
    runs: list[list[tuple[str, int]]] = []
    images: list[tuple[int, torch.Tensor, tuple[int, int], bool]] = []  # sample, tiles, size, multi
    videos: list[tuple[int, torch.Tensor, int]] = []
    batch_num_images: list[int] = []
    for s, sample in enumerate(samples):
        key = tuple((m.modality, m.size) for m in sample)
        gen = rng(seed, key)
        n_img = sum(m.modality == "image" for m in sample)
        if n_img:
            batch_num_images.append(n_img)
        row, sample_runs = _text(gen, text_len), []
        for k, media in enumerate(sample):
            pix = rng(seed, key, k)
            if media.modality == "image" and len(media.size) == 2:
                h, w = media.size
                n = llava_onevision_num_features(h, w, cfg, multi_image=n_img > 1)
                t = num_tiles(h, w, cfg, multi_image=n_img > 1)
                images.append(
                    (s, torch.randn((t, 3, tile, tile), generator=pix), (h, w), n_img > 1)
                )
            elif media.modality == "video" and len(media.size) == 1:
                (frames,) = media.size
                n = video_num_features(frames, cfg)
                videos.append((s, torch.randn((frames, 3, tile, tile), generator=pix), n))
            else:
                raise ValueError(
                    f"llava_onevision takes image (H, W) / video (frames,), got {media}"
                )
            n_ids = n if media.tokens is None else media.tokens
            row += [ids_of[media.modality]] * n_ids + _text(gen, text_len)
            sample_runs.append((media.modality, n_ids))
        rows.append(row)
        runs.append(sample_runs)
    if swap is not None:
        i, j = swap
        (si, ti, zi, mi), (sj, tj, zj, mj) = images[i], images[j]
        images[i], images[j] = (si, tj, zj, mi), (sj, ti, zi, mj)
    items = [
        (s, "image", llava_onevision_num_features(*z, cfg, multi_image=m)) for s, _, z, m in images
    ]
    items += [(s, "video", n) for s, _, n in videos]
    ids, mask = right_pad(rows, PAD_ID)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if images:
        most = max(t.shape[0] for _, t, _, _ in images)
        pv = torch.zeros((len(images), most, 3, tile, tile))
        for q, (_, t, _, _) in enumerate(images):
            pv[q, : t.shape[0]] = t
        kwargs["pixel_values"] = pv
        kwargs["image_sizes"] = torch.tensor([z for _, _, z, _ in images], dtype=torch.long)
        kwargs["batch_num_images"] = torch.tensor(batch_num_images, dtype=torch.long)
    if videos:
        if len({v.shape[0] for _, v, _ in videos}) > 1:
            raise ValueError(
                "videos of one batch must have the same frame count (they are stacked)"
            )
        kwargs["pixel_values_videos"] = torch.stack([v for _, v, _ in videos])
    return FamilyBatch(kwargs, items, runs, [len(r) for r in rows])
