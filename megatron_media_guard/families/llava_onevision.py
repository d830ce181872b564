"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration`` / ``LlavaOnevisionModel``):
``pixel_values`` ``[n, max_tiles, 3, S, S]``, ``pixel_values_videos`` ``[v, frames, 3, S, S]``;
grammar, counts (:mod:`.anyres_pixels`) and repair: docs/FAMILIES.md. The tower runs once on
the whole call with the caller's ``batch_num_images``: a kept multi-image sample keeps its
base + 1 counts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.host import to_host
from ..errors import MediaInputError
from ..geometry import AnyresGeometry
from .anyres_pixels import image_counts, stitch, tiles_for, video_counts
from .common import PAD, PIXELS, feature_call, hf_classes, tower_dummy
from .spec import Encoded, FamilySpec, ModalitySpec, Token

#: the forward keywords both feature methods take, beside the media
_SELECT = {k: k for k in ("vision_feature_layer", "vision_feature_select_strategy")}


def _features(model: Any, pv, sizes, bni, kw=None):  # one [N_q, h] per image, newlines too
    select = {p: (kw or {}).get(k) for p, k in _SELECT.items()}
    out = model.get_image_features(pv, sizes, **select, batch_num_images=bni, return_dict=True)
    return tuple(out.pooler_output)


def _encode_image(model: Any, kw) -> Encoded:
    pv, sizes, bni = kw["pixel_values"], kw["image_sizes"], kw.get("batch_num_images")
    feats = _features(model, pv, sizes, bni, kw)
    if not kw.get(PIXELS):
        return Encoded(feats)
    # repair only: sizes and images per sample on the host (one small transfer)
    n = sizes.shape[0]
    flat = sizes.flatten() if bni is None else torch.cat([sizes.flatten(), bni.to(sizes)])
    host = to_host(flat, why="image sizes and images per sample to rebuild items for repair")
    hw = host[: 2 * n].view(n, 2).tolist()
    multi = [c > 1 for c in host[2 * n :].tolist() for _ in range(c)] or [False] * n
    geo = _geometry(model)
    pixels = tuple(
        pv[q, :1] if multi[q] else stitch(geo, pv[q], h, w) for q, (h, w) in enumerate(hw)
    )  # a multi-image item: its one tile as [1, C, T, T], which _reencode_image refuses
    return Encoded(feats, frame_hw=tuple(map(tuple, hw)), pixels=pixels)


def _reencode_image(model: Any, img: torch.Tensor) -> torch.Tensor:
    geo = _geometry(model)
    if img.ndim != 3:
        raise MediaInputError(
            f"an image of a multi-image sample is one tile of base + 1 = {geo.side**2 + 1} "
            "features whatever its size: no resize changes its count"
        )
    one = torch.tensor([1], device=img.device)
    sizes = torch.tensor([list(img.shape[-2:])], device=img.device)
    return _features(model, tiles_for(geo, img)[None], sizes, one)[0]


def _geometry(model: Any) -> AnyresGeometry:
    cfg = model.config
    return AnyresGeometry(
        pinpoints=tuple(map(tuple, cfg.image_grid_pinpoints)),
        tile=int(cfg.vision_config.image_size),
        patch=int(cfg.vision_config.patch_size),
        max_tiles=int(cfg.vision_aspect_ratio.removeprefix("anyres_max_")),
    )


SPEC = FamilySpec(
    name="llava_onevision",
    classes=hf_classes("LlavaOnevision"),
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id", "image_token_index"), "<image>"),
            ("pixel_values", "image_sizes", "batch_num_images", *_SELECT),
            _encode_image,
            reencode=_reencode_image,
            rows=("pixel_values", "image_sizes"),
            groups=("batch_num_images",),
            counts=image_counts,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id", "video_token_index"), "<video>"),
            ("pixel_values_videos", "image_sizes_videos"),
            feature_call("get_video_features", "pixel_values_videos", **_SELECT),
            rows=("pixel_values_videos", "image_sizes_videos"),
            counts=video_counts,
        ),
    ),
    text=Token(PAD, "<|endoftext|>", 0),
    geometry=_geometry,
    ids_with_embeds=False,
    # one video frame of zeros (a single tile: no anyres pinpoint to match) through the tower,
    # the projector and the pooling, as the video encode runs them
    dummy=tower_dummy("get_video_features", lambda v: (1, 1, 3, v.image_size, v.image_size)),
)
