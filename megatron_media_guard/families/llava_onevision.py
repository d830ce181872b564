"""LLaVA-OneVision (transformers ``LlavaOnevisionForConditionalGeneration`` /
``LlavaOnevisionModel``; Megatron-Bridge 0.6.2 has no class for it).

- image: a bare run of ``<image>`` (``config.image_token_id``) per image, no markers. Its count
  is the model's own: anyres (the best pinpoint for ``image_sizes[n]``, unpadded, capped by
  ``anyres_max_k``, one newline feature per row, the base tile first), or base + 1 for an image
  of a sample with several (``batch_num_images[s] > 1``). ``pixel_values``
  ``[n, max_tiles, 3, S, S]``, ``image_sizes`` ``[n, 2]`` original (H, W), ``batch_num_images``
  ``[samples with images]``.
- video: a bare run of ``<video>`` per video, frames * ceil(side/2)^2 + 1;
  ``pixel_values_videos`` ``[v, frames, 3, S, S]`` stacked. Images are consumed before videos.

The tower runs once on the whole call, with the caller's ``batch_num_images``: a dropped
sample's items are left unplaced and nothing is encoded again, so a kept multi-image sample
keeps its base + 1 counts (re-encoding after removing one image of a two-image sample would
turn its sibling anyres: another count and tiles ``pixel_values`` does not hold).

Repair (anyres images, :class:`AnyresGeometry`): the item's tiles are a split of the image
resized into its best pinpoint and zero-padded (centred), so stitching them and cutting the
padding gives back that resized image exactly; it is resized to the solved size, cut into that
size's pinpoint tiles + base tile as the processor does (torch ops; the padding is the
processor's zero pixel, normalized with its default OPENAI_CLIP mean/std) and re-encoded by
``get_image_features`` as one single-image sample. An image of a multi-image sample is one
tile, base + 1 whatever its size: its repair falls back, saying so.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.host import to_host
from ..errors import MediaInputError
from ..geometry import AnyresGeometry
from .anyres_pixels import image_counts, stitch, tiles_for, video_counts
from .common import PAD, PIXELS, feature_call, hf_classes
from .spec import Encoded, FamilySpec, ModalitySpec, Token, tower_zeros

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


def _dummy(model: Any):
    """One video frame of zeros (a single tile: no anyres pinpoint to match) through the tower,
    the projector and the pooling, as the spec's video encode runs them."""
    size = int(model.config.vision_config.image_size)
    pv = tower_zeros(model, "vision_tower", 1, 1, 3, size, size)
    return model.get_video_features(pv, return_dict=True).pooler_output


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
    dummy=_dummy,
)
