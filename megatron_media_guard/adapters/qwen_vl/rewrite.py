"""Carrying out a Qwen-VL plan on the forward's inputs, before the model runs (no decisions).

Kept rows stay (repaired ones with their new patches and grid row), dropped samples' rows
leave ``pixel_values`` / the grids, their placeholders become a text id, and every tensor
that follows the ids (``mm_token_type_ids``, Bridge's ``image_input_mask`` /
``video_input_mask``, ``labels``, ``loss_mask``, ``second_per_grid_ts``) follows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import GuardConfig
from ...core.alignment import AlignmentReport
from ...core.apply import mask_dropped, token_keep, zero_anchor
from ...core.runs import TokenLayout
from .checks import (
    GRIDS,
    MODALITIES,
    PIXELS,
    TYPE_INPUTS,
    CallArgs,
    QwenVLSpec,
    attr_path,
    derived_types,
)
from .plan import GridRow, RowRepair


def removed_rows(
    report: AlignmentReport,
    item_row: Sequence[int],
    actions: list[str],
    config: GuardConfig,
) -> tuple[list[str], set[int]]:
    """Rows that must leave the inputs (owned by a dropped sample, or by none) and the actions
    after it: a sample that loses a row cannot keep its placeholders fed, so it is dropped too
    (raised under a raising policy)."""
    owner: list[int | None] = [None] * len(item_row)
    for rep in report.samples:
        for i in rep.items:
            owner[i] = rep.sample
    dropping = config.policy if config.policy != "repair" else config.fallback
    actions = list(actions)
    while True:
        gone = {
            item_row[i] for i, s in enumerate(owner) if s is None or actions[s] in ("drop", "raise")
        }
        hit = {s for i, s in enumerate(owner) if s is not None and item_row[i] in gone}
        more = [s for s in hit if actions[s] in ("keep", "repair")]
        if not more:
            return actions, gone
        for s in more:
            actions[s] = dropping


@dataclass(frozen=True)
class Rewritten:
    """What the rewrite changed, for the result and the post-forward hook."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None
    vision_emptied: bool  # every row left: the tower is anchored after the forward
    patch_dim: int | None
    pixel_dtype: torch.dtype | None
    pixel_device: torch.device | None


def rewrite(
    call: CallArgs,
    spec: QwenVLSpec,
    lay: TokenLayout,
    ids: torch.Tensor,
    rows: Sequence[GridRow],
    gone: set[int],
    repairs: Mapping[int, RowRepair],
    actions: Sequence[str],
    ignore_index: int,
    loss_mask_inplace: bool = False,
    strays: bool = False,
    row_sample: Sequence[int] | None = None,
) -> Rewritten:
    """Rewrites ``call`` for the plan (out of place, except ``loss_mask`` with
    ``loss_mask_inplace``: the caller's tensor is zeroed where samples were dropped, for a loss
    function that captured it before the forward, as Megatron-Bridge's forward steps do).
    strays: placeholders sit in a packed row's padding; they become text too (no item feeds
    them, and the model would count them). row_sample: the sample of each row (explicit
    items): each modality's kept rows are put in sample order, the order the model feeds them
    to the runs in."""
    keep = torch.tensor([a in ("keep", "repair") for a in actions], device=ids.device)
    dropped_ph = lay.ph & ~token_keep(lay, keep)
    new_ids = ids
    if any(a not in ("keep", "repair") for a in actions) or gone or strays:
        new_ids = ids.masked_fill(dropped_ph, spec.text_id)
        call.set("input_ids", new_ids)
    follow_ids(call, spec, new_ids)
    loss_mask, labels = call.get("loss_mask"), call.get("labels")
    if any(a == "drop" for a in actions):
        new_mask, labels = mask_dropped(lay, keep, loss_mask, labels, ignore_index)
        if loss_mask is not None and loss_mask_inplace:
            loss_mask.copy_(new_mask)
        elif loss_mask is not None:
            loss_mask = new_mask.to(loss_mask.dtype)
            call.set("loss_mask", loss_mask)
        if labels is not None:
            call.set("labels", labels)
    had = remain = 0
    patch_dim = dtype = device = None
    for m in MODALITIES:
        pix, grid = call.get(PIXELS[m]), call.get(GRIDS[m])
        mine = [(r, row) for r, row in enumerate(rows) if row.modality == m]
        if not mine:
            continue
        had += 1 if pix is not None else 0
        if pix is not None:
            patch_dim, dtype, device = pix.shape[1], pix.dtype, pix.device
        kept = [(r, row) for r, row in mine if r not in gone]
        if row_sample is not None:
            kept.sort(key=lambda rr: row_sample[rr[0]])  # stable: token order within a sample
        moved = [r for r, _ in kept] != [r for r, _ in mine if r not in gone]
        if not moved and not any(r in gone or r in repairs for r, _ in mine):
            remain += 1
            continue
        if grid is not None:
            thw = [repairs[r].thw if r in repairs else row.thw for r, row in kept]
            new_grid = (
                torch.tensor(thw, dtype=grid.dtype).to(grid.device, non_blocking=True)
                if kept
                else None
            )
            call.set(GRIDS[m], new_grid)
        if pix is not None:
            pieces = [
                repairs[r].patches
                if r in repairs and repairs[r].patches is not None
                else pix[row.offset : row.offset + row.patches]
                for r, row in kept
            ]
            call.set(PIXELS[m], torch.cat(pieces).to(pix.dtype) if pieces else None)
            remain += 1 if pieces else 0
        if m == "video":
            ts = call.get("second_per_grid_ts")
            if ts is not None:
                idx = [row.index for _, row in kept]
                if isinstance(ts, torch.Tensor):
                    sel = torch.tensor(idx, dtype=torch.long).to(ts.device)
                    ts = ts.index_select(0, sel) if idx else None
                else:
                    ts = [ts[i] for i in idx] if idx else None
                call.set("second_per_grid_ts", ts)
    if call.changed and call.get("position_ids") is not None:
        # MRoPE positions follow the grids: the model recomputes them from the new ones
        # (transformers only with mm_token_type_ids, so those are derived from the ids)
        call.set("position_ids", None)
        if "mm_token_type_ids" in call.names and call.get("mm_token_type_ids") is None:
            call.set("mm_token_type_ids", derived_types(new_ids, spec, "mm_token_type_ids"))
    return Rewritten(new_ids, loss_mask, labels, had > 0 and remain == 0, patch_dim, dtype, device)


def follow_ids(call: CallArgs, spec: QwenVLSpec, ids: torch.Tensor) -> None:
    """The given ``mm_token_type_ids`` / ``image_input_mask`` / ``video_input_mask`` rebuilt from
    ``ids`` (on their own device, in their own dtype): the ids are the truth."""
    for name in TYPE_INPUTS:
        given = call.get(name)
        if given is not None:
            call.set(name, derived_types(ids.to(given.device), spec, name).to(given.dtype))


def vision_tower(module: Any) -> Any:
    """The vision tower of a transformers or Megatron-Bridge Qwen-VL model (None if not here)."""
    return attr_path(module, "visual", "model.visual", "vision_model")


def _floats(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        vals = list(out.values())
    elif isinstance(out, (list, tuple)):
        vals = list(out)
    else:
        vals = [getattr(out, k) for k in getattr(out, "__dataclass_fields__", {})]
    return [t for v in vals if v is not None for t in _floats(v)]


def tower_anchor(module: Any, spec: QwenVLSpec, rw: Rewritten) -> torch.Tensor | None:
    """``-0.0`` depending on every vision-tower parameter: the tower runs once on one
    ``merge x merge`` cell of zeros (the batch had media, all of it dropped), so DDP/FSDP see
    its parameters used as in any other step."""
    tower = vision_tower(module)
    if tower is None or rw.patch_dim is None:
        return None
    m = spec.merge
    dummy = torch.zeros(m * m, rw.patch_dim, dtype=rw.pixel_dtype, device=rw.pixel_device)
    grid = torch.tensor([[1, m, m]], dtype=torch.long).to(rw.pixel_device)
    try:
        out = tower(dummy, grid_thw=grid)
    except TypeError:
        out = tower(hidden_states=dummy, grid_thw=grid)
    floats = _floats(out)
    return zero_anchor(*floats) if floats else None


def add_anchor(out: Any, anchor: torch.Tensor | None, all_dropped: bool) -> Any:
    """The model's output with ``anchor`` (-0.0: no bit changes) added to its loss / logits /
    hidden states; with every sample dropped, a ``loss`` that averaged over no label becomes a
    finite zero that still depends on the logits."""
    if isinstance(out, torch.Tensor):
        return out + anchor.to(out.dtype) if anchor is not None and out.is_floating_point() else out
    if isinstance(out, Mapping):
        for key in ("logits", "last_hidden_state", "loss"):
            val = out.get(key)
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                if key == "loss" and all_dropped and out.get("logits") is not None:
                    val = zero_anchor(out["logits"]).to(val.dtype).reshape(val.shape)
                if anchor is not None:
                    val = val + anchor.to(val.dtype)
                out[key] = val
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (add_anchor(out[0], anchor, False), *out[1:])
    return out
