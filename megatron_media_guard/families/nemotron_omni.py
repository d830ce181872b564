"""Nemotron 3 Nano Omni (``NemotronH_Omni_Reasoning_V3``); markers from the tokenizer. Its
grammar, counts and repair: docs/FAMILIES.md. A video is one run per tubelet on the *image*
token, merged per run; EVS after the merge."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..geometry import RadioTilerGeometry
from .common import PAD, mel_frames, patch_images, tower_dummy
from .evs import prune_video_tokens
from .layouts import PATCH, image_to_patches, patches_to_image
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table


def _encode_image(model: Any, kw) -> Encoded:
    out = model.get_image_features(kw["pixel_values"], kw["image_grid_hw"], return_dict=True)
    return patch_images(
        out.pooler_output, kw, "pixel_values", "image_grid_hw", PATCH, patches_to_image
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
    # no pixels: stacked videos, a tubelet resized alone would not stack (a fallback, no repair)
    return Encoded(tubelets, num_frames=(tp,) * n, frame_hw=((h, w),) * n, parent=parent)


def _encode_audio(model: Any, kw) -> Encoded:
    feats, mask = kw["input_features"], kw.get("input_features_mask")
    flat = model.get_audio_features(feats, mask).pooler_output  # every clip back to back
    if mask is None:  # every clip the whole window
        return Encoded(tuple(flat.split(flat.shape[0] // feats.shape[0])))
    # their lengths (on the device) cut them per item once the merge's one transfer brings
    # them (Encoded.counts)
    lengths = model.audio_tower._get_subsampling_output_length(mask.sum(-1) + 1)
    return Encoded((flat,), counts=lengths)


def _image_counts(config: Any, kw) -> torch.Tensor:
    hw = kw["image_grid_hw"].long()
    return count_table(hw.prod(-1) // 4, hw=hw * PATCH)


def _video_counts(config: Any, kw) -> torch.Tensor:
    pv = kw["pixel_values_videos"]
    v, t, _, h, w = pv.shape
    n = torch.full((v,), (h // PATCH) * (w // PATCH) // 4, device=pv.device)
    tp = int(getattr(config, "video_temporal_patch_size", 2))
    return count_table(n, runs=t, frames=tp, hw=(h, w))


def _audio_counts(config: Any, kw) -> torch.Tensor:
    """Parakeet's conv subsampling (the tower's ``_get_subsampling_output_length``) on the
    model's input length ``mask.sum(-1) + 1``: ``floor((x + pad) / stride + 1)`` per stage."""
    a = config.audio_config
    k, stride = a.subsampling_conv_kernel_size, a.subsampling_conv_stride
    pad = (k - 1) // 2 * 2 - k
    mask = kw.get("input_features_mask")
    n = mel_frames(kw["input_features"], mask, 1) + (mask is not None)  # the model's length
    for _ in range(int(math.log2(a.subsampling_factor))):
        n = torch.div(n + pad, stride, rounding_mode="floor") + 1
    return count_table(n)


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
            rows=("image_grid_hw",),
            patches={"pixel_values": "image_grid_hw"},
            counts=_image_counts,
        ),
        ModalitySpec(
            "video",
            Token(("image_token_id",), "<image>"),
            ("pixel_values_videos",),
            _encode_video,
            shares="image",
            rows=("pixel_values_videos",),
            counts=_video_counts,
        ),
        ModalitySpec(
            "audio",
            Token(("audio_token_id",), "<so_embedding>"),
            ("input_features", "input_features_mask"),
            _encode_audio,
            start=Token((), "<so_start>"),
            end=Token((), "<so_end>"),
            rows=("input_features", "input_features_mask"),
            counts=_audio_counts,
        ),
    ),
    text=Token(PAD, "<unk>", 0),
    geometry=lambda model: RadioTilerGeometry(patch=PATCH, pixel_shuffle=2),
    after_merge=prune_video_tokens,
    # one 2x2-patch image of zeros through the model's own tower path
    dummy=tower_dummy(
        "get_image_features", lambda v: (4, 3 * PATCH**2), lambda v: [[2, 2]], "vision_model"
    ),
)
