"""What several family specs share beside the data model (:mod:`.spec`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..core.host import to_host
from .spec import Encode, Encoded, count_table, tower_zeros

#: the text token most families' dropped placeholders become: the config's pad token
PAD = ("text_config.pad_token_id", "pad_token_id")

#: the keyword the engine sets when it wants each item's pixels (repair): an ``encode`` then
#: also fills ``Encoded.frame_hw`` and ``pixels``
PIXELS = "_media_guard_pixels"


def hf_classes(*prefixes: str) -> dict[str, frozenset[str]]:
    """``FamilySpec.classes`` for transformers' ``<prefix>ForConditionalGeneration`` and
    ``<prefix>Model`` of each prefix."""
    suffixes = ("ForConditionalGeneration", "Model")
    return {"transformers.": frozenset(p + s for p in prefixes for s in suffixes)}


def feature_call(method: str, *args: str, **keywords: str) -> Encode:
    """An ``encode`` calling the model's own ``method`` on the inputs ``args`` (positional) and
    ``keywords`` (``{parameter: input}``): one item per entry of its ``pooler_output``."""

    def encode(model: Any, kw: Mapping[str, Any]) -> Encoded:
        named = {p: kw.get(k) for p, k in keywords.items()}
        out = getattr(model, method)(*(kw[a] for a in args), **named, return_dict=True)
        return Encoded(tuple(out.pooler_output))

    return encode


def tower_dummy(
    method: str,
    zeros: Callable[[Any], tuple[int, ...]],
    grid: Callable[[Any], list] | None = None,
    tower: str = "vision_tower",
):
    """A spec's ``dummy`` (``GuardConfig.keep_tower``): zeros of the shape ``zeros(vision
    config)`` (:func:`~.spec.tower_zeros` of ``tower``), then ``grid(vision config)`` as a
    tensor where given, through the model's own ``method``: its whole output."""

    def dummy(model: Any):
        v = model.config.vision_config
        pv = tower_zeros(model, tower, *zeros(v))
        extra = () if grid is None else (torch.tensor(grid(v), device=pv.device),)
        return getattr(model, method)(pv, *extra, return_dict=True)

    return dummy


def patch_images(
    feats: Sequence[torch.Tensor], kw: Mapping[str, Any], rows: str, grid: str, patch: int, image
) -> Encoded:
    """The ``Encoded`` of images given as flat patch rows (``prod(grid row)`` rows each, the
    row's last two entries its patches high and wide), with each image's ``[C, H, W]``
    (``image(its rows, h, w)``) when the engine asks for pixels (:data:`PIXELS`)."""
    if not kw.get(PIXELS):
        return Encoded(tuple(feats))
    g = to_host(kw[grid], why="image grids to cut each item's patch rows for repair").tolist()
    cut = kw[rows].split([math.prod(r) for r in g])
    return Encoded(
        tuple(feats),
        frame_hw=tuple((patch * r[-2], patch * r[-1]) for r in g),
        pixels=tuple(image(x, r[-2], r[-1]) for x, r in zip(cut, g)),
    )


def grid_table(
    thw: torch.Tensor, div: int, patch: int, t: str = "tokens", frames_per: int = 0
) -> torch.Tensor:
    """The count table of ``[n, 3]`` (t, h, w) grid rows: one run of ``t*h*w / div`` per row
    (``t="tokens"``; ``t * frames_per`` frames), ``t`` runs of ``h*w / div`` (``"runs"``), or
    one run of ``h*w / div`` over ``t`` frames (``"frames"``: frames pooled)."""
    thw = thw.long()
    hw = thw[:, 1:]
    if t == "tokens":
        frames = thw[:, 0] * frames_per
        return count_table(thw.prod(-1) // div, frames=frames, hw=hw * patch, grid=thw)
    runs, frames = (thw[:, 0], 0) if t == "runs" else (1, thw[:, 0])
    return count_table(hw.prod(-1) // div, runs=runs, frames=frames, hw=hw * patch, grid=thw)


def mel_frames(x: torch.Tensor, mask: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """Per clip of ``x`` its frames: ``mask.sum(-1)``, else the whole window (``x.shape[dim]``)."""
    if mask is not None:
        return mask.sum(-1).long()
    return torch.full(x.shape[:1], x.shape[dim], dtype=torch.long, device=x.device)
