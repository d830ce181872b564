"""Mistral 3 / Pixtral (``Mistral3ForConditionalGeneration`` / ``Mistral3Model``; Bridge
``Ministral3Model``): ``pixel_values`` ``[n, 3, maxH, maxW]`` zero-padded; grammar, counts and
repair: docs/FAMILIES.md."""

from __future__ import annotations

from typing import Any

import torch

from ..core.host import to_host
from ..geometry import PixtralGeometry
from .common import PAD, PIXELS, hf_classes
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table, tower_zeros


def _features(model: Any, pixels: torch.Tensor, sizes: torch.Tensor, layer=None):
    out = model.get_image_features(
        pixels, image_sizes=sizes, vision_feature_layer=layer, return_dict=True
    )
    return tuple(out.pooler_output)


def _encode_image(model: Any, kw) -> Encoded:
    pv, sizes = kw["pixel_values"], kw["image_sizes"]
    feats = _features(model, pv, sizes, kw.get("vision_feature_layer"))
    if not kw.get(PIXELS):
        return Encoded(feats)
    # repair only: the sizes on the host to cut each image out of its padding (one small transfer)
    hw = to_host(sizes, why="image sizes to cut each item's pixels for repair").tolist()
    return Encoded(
        feats,
        frame_hw=tuple((h, w) for h, w in hw),
        pixels=tuple(pv[n, :, :h, :w] for n, (h, w) in enumerate(hw)),
    )


def _reencode_image(model: Any, img: torch.Tensor) -> torch.Tensor:
    sizes = torch.tensor([list(img.shape[-2:])], dtype=torch.long, device=img.device)
    return _features(model, img[None], sizes)[0]


def _geometry(config: Any) -> PixtralGeometry:
    cfg = getattr(config, "hf_config", config)  # Bridge keeps HF's config there
    vis = cfg.vision_config
    return PixtralGeometry(
        longest_edge=int(vis.image_size),
        patch=int(vis.patch_size),
        merge=int(getattr(cfg, "spatial_merge_size", 2)),
    )


def _counts(config: Any, kw) -> torch.Tensor:
    """``(H // p) * (W // p)`` per ``image_sizes`` row (``p = patch * spatial_merge_size``,
    the patch merger's split), its ``[IMG_BREAK]`` / ``[IMG_END]`` taking none."""
    g = _geometry(config)
    sizes = kw["image_sizes"]
    rows, cols = (sizes // (g.patch * g.merge)).unbind(-1)
    return count_table(rows * cols, hw=sizes, grid=torch.stack([rows * 0 + 1, rows, cols], -1))


def _dummy(model: Any):
    """An image of zeros of two features (one would be squeezed flat by the model's own
    ``get_image_features``), through the tower, the patch merger and the projector."""
    g = _geometry(model.config)
    side = g.patch * g.merge
    pv = tower_zeros(model, "vision_tower", 1, 3, side, 2 * side)
    sizes = torch.tensor([[side, 2 * side]], device=pv.device)
    return _features(model, pv, sizes)


SPEC = FamilySpec(
    name="mistral3",
    classes=hf_classes("Mistral3"),
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id", "image_token_index"), "[IMG]"),
            ("pixel_values", "image_sizes", "vision_feature_layer"),
            _encode_image,
            end=Token((), "[IMG_END]"),
            breaks=(Token((), "[IMG_BREAK]"),),
            reencode=_reencode_image,
            rows=("pixel_values", "image_sizes"),
            counts=_counts,
        ),
    ),
    text=Token(PAD, "<pad>", 0),
    geometry=lambda model: _geometry(model.config),
    ids_with_embeds=False,
    dummy=_dummy,
)

#: Megatron-Bridge 0.6.2 ``Ministral3Model``: it merges only while ``pixel_values`` is given
BRIDGE = SPEC.bridge("Ministral3Model")
