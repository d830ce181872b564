"""Carrying out a Qwen-VL plan on the forward's inputs, before the model runs (no decisions).

Kept rows stay (repaired ones with their new patches and grid row), dropped samples' rows
leave ``pixel_values`` / the grids, their placeholders become a text id, and every tensor
that follows the ids (``mm_token_type_ids``, Bridge's ``image_input_mask`` /
``video_input_mask``, ``labels``, ``loss_mask``, ``second_per_grid_ts``) follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import GuardConfig
from ...core.alignment import AlignmentReport
from ...core.apply import mask_dropped
from ...core.runs import TokenLayout
from ...families import qwen
from ...families.inputs import placeholders_as_text, take_items
from ..forward_hook import CallArgs
from .checks import (
    MODALITIES,
    TYPE_INPUTS,
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
    """What the rewrite changed, for the result."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None


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
    new_ids = ids
    if any(a not in ("keep", "repair") for a in actions) or gone or strays:
        new_ids = placeholders_as_text(qwen.SPEC, {"input_ids": ids}, lay, keep, spec.text_id)
        new_ids = new_ids["input_ids"]
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
    # the rows the plan keeps (repaired ones resized), through the spec's rows / patches
    kept_rows, sizes, fixed = {}, {}, {}
    for m in MODALITIES:
        mine = [(r, row) for r, row in enumerate(rows) if row.modality == m]
        kept = [(r, row) for r, row in mine if r not in gone]
        if row_sample is not None:
            kept.sort(key=lambda rr: row_sample[rr[0]])  # stable: token order within a sample
        kept_rows[m] = [row.index for _, row in kept]
        sizes[m] = [row.patches for _, row in mine]
        fixed.update(
            {
                (m, row.index): (repairs[r].thw, repairs[r].patches)
                for r, row in kept
                if r in repairs
            }
        )
    mods = qwen.SPEC.modalities
    view = {n: call.get(n) for m in mods for n in (*m.rows, *m.patches)}
    for name, value in take_items(view, mods, kept_rows, sizes=sizes, repaired=fixed).items():
        call.set(name, value)
    if call.changed and call.get("position_ids") is not None:
        # MRoPE positions follow the grids: the model recomputes them from the new ones
        # (transformers only with mm_token_type_ids, so those are derived from the ids)
        call.set("position_ids", None)
        if "mm_token_type_ids" in call.names and call.get("mm_token_type_ids") is None:
            call.set("mm_token_type_ids", derived_types(new_ids, spec, "mm_token_type_ids"))
    return Rewritten(new_ids, loss_mask, labels)


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


def dummy_cell(module: Any, spec: QwenVLSpec, device: torch.device) -> Callable[[], Any] | None:
    """The model's own vision tower on one ``merge x merge`` cell of zeros (grid
    ``[[1, merge, merge]]``: the smallest input it takes), in the tower's parameter dtype, for
    :meth:`~..tower.TowerKeeper.run`; None when the model has no tower here (a pipeline stage
    without it)."""
    tower = vision_tower(module)
    if tower is None:
        return None
    dtype = next((p.dtype for p in tower.parameters() if p.is_floating_point()), torch.float32)
    m = spec.merge

    def run() -> Any:
        dummy = torch.zeros(m * m, spec.patch_dim, dtype=dtype, device=device)
        grid = torch.tensor([[1, m, m]], dtype=torch.long).to(device, non_blocking=True)
        try:
            return tower(dummy, grid_thw=grid)
        except TypeError:  # Bridge's Qwen3-VL vision model takes keywords only
            return tower(hidden_states=dummy, grid_thw=grid)

    return run
