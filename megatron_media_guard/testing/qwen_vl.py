"""Tiny Qwen-VL models and processor-made inputs for tests and benchmarks (never imported by
the runtime). Images go through transformers' real ``Qwen2VLImageProcessorPil``; the video
processor needs torchvision (no CPU wheel here), so :func:`video_patches` restates its
resize-and-patchify: each frame resized by the processor's ``smart_resize`` size (PIL bicubic),
rescaled, normalized with the CLIP mean/std, the clip padded to a multiple of the temporal
patch by repeating its last frame, and flattened to ``[t*h*w, C*tp*p*p]`` in the processor's
patch order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653


def tiny_config(family: str):
    """A tiny random config (vision depth 2, hidden 32/64, 2 text layers), default token ids and
    vocabulary."""
    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        vision.update(fullatt_block_indexes=[1], window_size=56)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    from transformers import Qwen3VLConfig

    text.update(
        head_dim=16,
        rope_scaling={
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    vision.update(deepstack_visual_indexes=[0, 1], num_position_embeddings=64)
    return Qwen3VLConfig(text_config=text, vision_config=vision)


def tiny_model(family: str, head: bool = True, seed: int = 0) -> torch.nn.Module:
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLModel,
        Qwen3VLForConditionalGeneration,
        Qwen3VLModel,
    )

    torch.manual_seed(seed)
    cls = {
        ("qwen2_5_vl", True): Qwen2_5_VLForConditionalGeneration,
        ("qwen2_5_vl", False): Qwen2_5_VLModel,
        ("qwen3_vl", True): Qwen3VLForConditionalGeneration,
        ("qwen3_vl", False): Qwen3VLModel,
    }[(family, head)]
    return cls(tiny_config(family)).eval()


def image_processor(patch: int, max_pixels: int, min_pixels: int = 0):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=min_pixels or (patch * 2) ** 2,
        max_pixels=max_pixels,
    )


def image_inputs(images: list[np.ndarray], patch: int, max_pixels: int):
    """``(pixel_values, image_grid_thw)`` from the real image processor (PIL backend)."""
    from PIL import Image

    proc = image_processor(patch, max_pixels)
    out = proc(images=[Image.fromarray(a) for a in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def video_patches(frames: np.ndarray, patch: int, max_pixels: int, tp: int = 2, merge: int = 2):
    """One clip ``[T, H, W, 3]`` uint8 as the Qwen2-VL video processor makes it (see module doc)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    T, H, W, _ = frames.shape
    f = patch * merge
    h, w = smart_resize(H, W, factor=f, min_pixels=f * f, max_pixels=max_pixels)
    res = (
        np.stack(
            [
                np.asarray(Image.fromarray(fr).resize((w, h), resample=Image.BICUBIC))
                for fr in frames
            ]
        ).astype(np.float32)
        / 255.0
    )
    res = (res - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)
    video = res.transpose(0, 3, 1, 2)  # T, C, H, W
    if pad := -T % tp:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    gt, gh, gw = video.shape[0] // tp, h // patch, w // patch
    x = video.reshape(gt, tp, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3 * tp * patch * patch)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.tensor([[gt, gh, gw]])


@dataclass(frozen=True)
class Sample:
    """One sample's media: ("image", array) or ("video", frames)."""

    media: tuple


def build_batch(samples, family: str, patch: int, max_pixels: int, rng=None, text=3, pad=0):
    """``input_ids``, ``mm_token_type_ids`` and the pixels / grids of a batch whose placeholder
    runs follow these media at ``max_pixels`` (rows right-padded with ``pad``)."""
    rng = rng or np.random.default_rng(0)
    imgs = [a for s in samples for kind, a in s.media if kind == "image"]
    vids = [a for s in samples for kind, a in s.media if kind == "video"]
    pv, ig = image_inputs(imgs, patch, max_pixels) if imgs else (None, None)
    vparts = [video_patches(v, patch, max_pixels) for v in vids]
    pvv = torch.cat([p for p, _ in vparts]) if vparts else None
    vg = torch.cat([g for _, g in vparts]) if vparts else None
    rows, ii, vi = [], 0, 0
    for s in samples:
        row = list(rng.integers(100, 1000, size=text))
        for kind, _ in s.media:
            if kind == "image":
                t, h, w = ig[ii].tolist()
                ii += 1
                row += [START] + [IMAGE] * (t * h * w // 4) + [END]
            else:
                t, h, w = vg[vi].tolist()
                vi += 1
                if family == "qwen3_vl":
                    for _ in range(t):
                        row += list(rng.integers(100, 1000, size=2))  # "<t seconds>"
                        row += [START] + [VIDEO] * (h * w // 4) + [END]
                else:
                    row += [START] + [VIDEO] * (t * h * w // 4) + [END]
            row += list(rng.integers(100, 1000, size=text))
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt[ids == IMAGE] = 1
    tt[ids == VIDEO] = 2
    return dict(
        input_ids=ids,
        attention_mask=attn,
        mm_token_type_ids=tt,
        pixel_values=pv,
        image_grid_thw=ig,
        pixel_values_videos=pvv,
        video_grid_thw=vg,
    )


def patch_of(family: str) -> int:
    return 16 if family == "qwen3_vl" else 14


def seed_failure(family: str, samples, engine_cells: int, trainer_cells: int):
    """The seed failure on a batch: ``(engine, trainer_pixels)``. ``engine`` is the batch the
    engine sized (its runs, its pixels: the reference), ``trainer_pixels`` the same token ids
    with the pixels and grids the trainer's processor made at its larger static budget
    (budgets in merged cells: ``cells * (patch * merge)**2`` pixels)."""
    f = patch_of(family) * 2
    engine = build_batch(samples, family, patch_of(family), engine_cells * f * f)
    trainer = build_batch(samples, family, patch_of(family), trainer_cells * f * f)
    mixed = dict(engine)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        mixed[key] = trainer[key]
    return engine, mixed


def smooth_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A natural-looking ``[H, W, 3]`` uint8 image: low-frequency content (8x8 random colors
    upsampled, bicubic). White noise would make any two resizes disagree."""
    from PIL import Image

    base = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(base).resize((width, height), resample=Image.BICUBIC))


def smooth_clip(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.stack([smooth_image(height, width, seed + k) for k in range(frames)])


def source_items(samples, batch, merge: int = 2) -> list:
    """One ``MediaItem`` per grid row of ``batch`` (its images, then its videos, each in sample
    order) with its sample and its original's size (``source_hw``): what a trainer that kept
    the originals passes to ``set_items``, so that a repair replays the engine's own sizing
    instead of guessing from the trainer's frame."""
    from ..core.items import MediaItem

    out = []
    for modality in ("image", "video"):
        grid = batch.get(f"{modality}_grid_thw")
        rows = [] if grid is None else grid.tolist()
        media = [
            (s, m) for s, smp in enumerate(samples) for kind, m in smp.media if kind == modality
        ]
        for (t, h, w), (s, m) in zip(rows, media, strict=True):
            hw = tuple(int(x) for x in m.shape[-3:-1])  # [H, W, 3] or [T, H, W, 3]
            out.append(MediaItem(t * h * w // merge**2, sample=s, modality=modality, source_hw=hw))
    return out
