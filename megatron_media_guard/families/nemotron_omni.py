"""Nemotron 3 Nano Omni (transformers ``NemotronH_Omni_Reasoning_V3``): RADIO images, video
tubelets on the same image token, Parakeet audio.

- image: ``<img>`` ``<image>``xN ``</img>``; ``pixel_values`` ``[sum(gh*gw), 3*16*16]`` patch rows
  (row-major patches, channel-major within a patch) with ``image_grid_hw`` ``[n, 2]``;
  N = gh*gw/4 (pixel shuffle 0.5).
- video: one ``<img>...</img>`` run per tubelet on the *image* token, each after its
  "Frame k sampled at t seconds: " text; ``pixel_values_videos`` ``[V, T, 2*3, H, W]`` stacked;
  (H/16)(W/16)/4 per tubelet. The plain model scatters images and videos into every image-token
  position in turn, so it cannot take a batch with both; the guard merges per run in token order.
- audio: ``<so_start>`` ``<so_embedding>``xN ``<so_end>``; ``input_features`` ``[n, L, mel]`` with
  ``input_features_mask``; N from the tower's own ``_get_subsampling_output_length``.

The config carries ``image_token_id`` / ``audio_token_id`` (None by default); the markers come
from the tokenizer. Image repair: the item's patch rows become an image, are resized to the
RADIO tiler's grid for the run's length (``RadioTilerGeometry``; the engine's budget replayed)
and re-encoded through ``get_image_features``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..core.host import to_host
from ..geometry import RadioTilerGeometry
from .spec import Encoded, FamilySpec, Merged, ModalitySpec, Token, split_rows

PATCH = 16


def patches_to_image(rows: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """``[gh*gw, C*16*16]`` patch rows -> ``[C, 16*gh, 16*gw]`` pixels."""
    c = rows.shape[1] // (PATCH * PATCH)
    x = rows.reshape(gh, gw, c, PATCH, PATCH).permute(2, 0, 3, 1, 4)
    return x.reshape(c, gh * PATCH, gw * PATCH)


def image_to_patches(img: torch.Tensor) -> torch.Tensor:
    """``[C, H, W]`` (H, W multiples of 16) -> ``[(H/16)*(W/16), C*16*16]`` patch rows."""
    c, h, w = img.shape
    x = img.reshape(c, h // PATCH, PATCH, w // PATCH, PATCH).permute(1, 3, 0, 2, 4)
    return x.reshape((h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def _encode_image(model: Any, kw) -> Encoded:
    pv, grid = kw["pixel_values"], kw["image_grid_hw"]
    feats = model.get_image_features(pv, grid, return_dict=True).pooler_output
    feats = split_rows(feats, [])
    if not kw.get("_media_guard_pixels"):
        return Encoded(feats)
    # repair only: the grids on the host to cut each image's patch rows (one small transfer)
    hw = to_host(grid, why="image grids to cut each item's patch rows for repair").tolist()
    pix, off = [], 0
    for gh, gw in hw:
        pix.append(patches_to_image(pv[off : off + gh * gw], gh, gw))
        off += gh * gw
    return Encoded(
        feats,
        num_frames=(None,) * len(hw),
        frame_hw=tuple((PATCH * gh, PATCH * gw) for gh, gw in hw),
        pixels=tuple(pix),
    )


def _reencode_image(model: Any, img: torch.Tensor) -> torch.Tensor:
    gh, gw = img.shape[-2] // PATCH, img.shape[-1] // PATCH
    grid = torch.tensor([[gh, gw]], dtype=torch.long, device=img.device)
    out = model.get_image_features(image_to_patches(img), grid, return_dict=True)
    return out.pooler_output[0]


def _encode_video(model: Any, kw) -> Encoded:
    pv = kw["pixel_values_videos"]
    out = model.get_video_features(pv, return_dict=True).pooler_output
    h, w = pv.shape[-2:]  # [V, T, 2*3, H, W] (or one video's [frames, 3, H, W], deprecated)
    per = (h // PATCH) * (w // PATCH) // 4
    split = [video.split(per) for video in out]
    tubelets = tuple(f for groups in split for f in groups)
    parent = tuple(v for v, groups in enumerate(split) for _ in groups)
    tp = int(getattr(model.config, "video_temporal_patch_size", 2))
    n = len(tubelets)
    # no pixels for repair: the videos of a call are stacked, so one tubelet resized alone
    # would not stack with the others; a mismatched video takes the fallback
    return Encoded(tubelets, num_frames=(tp,) * n, frame_hw=((h, w),) * n, parent=parent)


def _encode_audio(model: Any, kw) -> Encoded:
    feats, mask = kw["input_features"], kw.get("input_features_mask")
    flat = model.get_audio_features(feats, mask).pooler_output
    if mask is None:
        sizes = [flat.shape[0] // feats.shape[0]] * feats.shape[0]
    else:
        lengths = model.audio_tower._get_subsampling_output_length(mask.sum(-1) + 1)
        # the flat features hold every clip back to back: their lengths cut them per item
        sizes = to_host(lengths, why="audio clip lengths to cut the flat features").tolist()
    return Encoded(split_rows(flat, sizes))


def _evs(model: Any, merged: Merged) -> dict[str, Any]:
    """Efficient video sampling (``video_pruning_rate > 0``): each video's tokens pruned after
    the merge with the model's own ``compute_retention_mask`` on that video's features, as the
    plain forward does, and rows of unequal length right-padded (attention mask 0, labels
    ignored) where the plain forward's ``.view(batch, -1)`` would move tokens between rows."""
    rate = float(getattr(model, "video_pruning_rate", 0) or 0)
    runs = [(k, r) for k, r in enumerate(merged.runs) if r[0].modality == "video"]
    if rate <= 0 or not runs:
        return {}
    retention = sys.modules[type(model).__module__].compute_retention_mask
    kw = merged.kwargs
    ids = kw["input_ids"]
    keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    video: dict[int, list[int]] = {}  # per video of a kept sample, its runs in order
    for k, (_, _, kept, owner) in runs:
        if kept:
            video.setdefault(owner, []).append(k)
    for group in video.values():
        feats = torch.cat([merged.features[k] for k in group])
        mask = retention(feats, len(group), rate)
        at = 0
        for k in group:
            row, a, b = merged.runs[k][1]
            keep[row, a:b] = mask[at : at + b - a]
            at += b - a
    lengths = keep.sum(1)
    # the new row lengths size the pruned tensors (one small transfer, EVS calls only)
    n = to_host(lengths, why="row lengths after EVS pruning").tolist()
    width = max(n)
    out: dict[str, Any] = {}
    pad = {"inputs_embeds": 0.0, "input_ids": 0, "attention_mask": 0, "labels": -100}
    for name, fill in pad.items():
        t = kw.get(name)
        if t is None:
            continue
        new = t.new_full((t.shape[0], width, *t.shape[2:]), fill)
        for r in range(t.shape[0]):  # rows, not tokens
            new[r, : n[r]] = t[r][keep[r]]
        out[name] = new
    if kw.get("attention_mask") is None and min(n) != width:
        cols = torch.arange(width, device=ids.device)
        out["attention_mask"] = (cols[None] < lengths[:, None]).long()
    return out


def _geometry(model: Any) -> RadioTilerGeometry:
    return RadioTilerGeometry(patch=PATCH, pixel_shuffle=2)


SPEC = FamilySpec(
    name="nemotron_omni",
    classes={"transformers.": frozenset({"NemotronH_Omni_Reasoning_V3"})},
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<image>"),
            ("pixel_values", "image_grid_hw"),
            _encode_image,
            start=Token((), "<img>"),
            end=Token((), "</img>"),
            reencode=_reencode_image,
        ),
        ModalitySpec(
            "video",
            Token(("image_token_id",), "<image>"),
            ("pixel_values_videos",),
            _encode_video,
            shares="image",
        ),
        ModalitySpec(
            "audio",
            Token(("audio_token_id",), "<so_embedding>"),
            ("input_features", "input_features_mask"),
            _encode_audio,
            start=Token((), "<so_start>"),
            end=Token((), "<so_end>"),
        ),
    ),
    text=Token(("text_config.pad_token_id", "pad_token_id"), "<unk>", 0),
    geometry=_geometry,
    after_merge=_evs,
)
