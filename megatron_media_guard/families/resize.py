"""Repair in the ``inputs`` mode, before the model's one tower call: a mismatched item's patch
rows (``ModalitySpec.patches``) resized to the grid the geometry solves for its runs.
:class:`Resizer` is the guard's ``encoder`` (as the collate check's
:class:`~.reprocess.Reprocessor`): it refuses an item whose runs lie in two samples and keeps
each solved ``(grid, patches)`` for the input rewrite (:func:`~.inputs.drop_inputs`'
``repaired``); the model's own forward encodes the resized rows, once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import torch

from ..core.host import to_host
from ..core.items import MediaItem
from ..core.plan import ItemRepair, Plan
from ..core.repairs import media_hw, solve_allowed
from ..repair.reproject import resize_patches
from .spec import ModalitySpec

Key = tuple[str, int]  # (modality, model-level item)


class Resizer:
    """The planned repairs of one call. parent: per item (one per run) its model-level item;
    geometry: one, or ``{modality: geometry}``; split: why an item whose runs lie in several
    samples is refused."""

    def __init__(
        self,
        mods: Sequence[ModalitySpec],
        items: Sequence[MediaItem],
        parent: Sequence[int],
        inputs: Mapping[str, Any],
        geometry: Any,
        split: Mapping[Key, str] | None = None,
    ) -> None:
        self.mods = {m.name: m for m in mods}
        self.key = {id(it): (it.modality, k) for it, k in zip(items, parent)}
        self.runs = Counter(self.key.values())
        self.inputs = inputs
        self.geometry = geometry
        self.split = dict(split or {})
        self.done: dict[Key, tuple[tuple[int, int, int], torch.Tensor | None]] = {}
        self.failed: dict[Key, str] = {}
        self._offsets: dict[str, list[int]] = {}

    def reprocess(self, r: ItemRepair, plan: Plan, batch, ctx) -> tuple[Any, dict]:
        """One planned repair (``core.repairs``' hook): (zero-width rows or None, facts)."""
        item = batch.items[r.item]
        key = self.key.get(id(item))
        facts: dict = {"target": r.target}
        if key is None:
            facts["reason"] = "cannot repair: the item is not one of the call's"
            return None, facts
        if key in self.done:  # another run of the same video, solved with it
            thw = self.done[key][0]
            facts.update(grid=thw, reason="resized with its video's other runs")
            return torch.empty(r.target, 0), facts
        if key in self.failed:
            facts["reason"] = self.failed[key]
            return None, facts
        thw, why = self._solve(key, r, item, ctx, facts, self._targets(key, plan, batch))
        if thw is None:
            self.failed[key] = facts["reason"] = why
            return None, facts
        facts["grid"] = thw
        return torch.empty(r.target, 0), facts

    def _solve(self, key: Key, r: ItemRepair, item: MediaItem, ctx, facts: dict, want: set):
        t0 = time.perf_counter()
        mod, k = key
        if key in self.split:
            return None, f"cannot repair: {self.split[key]}"
        geo = self.geometry.get(mod) if isinstance(self.geometry, Mapping) else self.geometry
        if geo is None:
            return None, f"cannot repair: no geometry for {mod}"
        if len(want) > 1:
            return None, f"cannot repair: the runs of {mod} {k} ask for sizes {sorted(want)}"
        runs = self.runs[key]
        total = r.target * runs
        thw0 = item.grid_thw
        if thw0 is None:
            return None, f"cannot repair: no grid for {mod} {k}"
        p, m, tp = geo.patch, geo.merge, getattr(geo, "temporal_patch", 1) or 1
        frames = thw0[0] * tp if mod == "video" else 1
        hw, kind = media_hw(item)
        sol, why_not = solve_allowed(geo, total, hw, frames, ctx.config, kind)
        facts.update(fidelity=sol.fidelity, size_hw=sol.size_hw, reason=sol.reason)
        if why_not is not None:
            return None, why_not
        ph, pw = sol.size_hw
        thw = (thw0[0], ph // p, pw // p)
        if ph % (p * m) or pw % (p * m) or thw[0] * (thw[1] // m) * (thw[2] // m) != total:
            return None, (
                f"the solved size {sol.size_hw} is no grid of {total} features for patch {p}, "
                f"merge {m} (the geometry's patch/merge differ from the model's)"
            )
        patches = None
        spec = self.mods[mod]
        for name in spec.patches:
            x = self.inputs.get(name)
            if not isinstance(x, torch.Tensor):
                continue
            off = self._offset(mod, name)
            src = x[off[k] : off[k + 1]]
            try:
                patches, _ = resize_patches(
                    src, thw0, (ph, pw), patch=p, temporal_patch=tp, merge=m
                )
            except Exception as exc:  # OOM, shape errors: recorded, then the fallback
                return None, f"resize failed: {type(exc).__name__}: {exc}"[:500]
        facts["duration_ms"] = (time.perf_counter() - t0) * 1e3
        self.done[key] = (thw, patches)
        return thw, None

    def _targets(self, key: Key, plan: Plan, batch) -> set[int]:
        """What each run of ``key`` must hold: its planned target, else its own count."""
        by_item = {r.item: r.target for r in plan.repairs}
        return {
            by_item.get(i, it.num_features)
            for i, it in enumerate(batch.items)
            if self.key.get(id(it)) == key
        }

    def _offset(self, mod: str, name: str) -> list[int]:
        """The first patch row of each model-level item in ``name`` (its grid on the host:
        one transfer, repairs only)."""
        if name not in self._offsets:
            grid = self.inputs[self.mods[mod].patches[name]]
            rows = to_host(grid.long().prod(-1), why="patch rows per item to repair").tolist()
            self._offsets[name] = list(accumulate(rows, initial=0))
        return self._offsets[name]

    def repaired(self, kept: set[int], sample_of: Mapping[Key, int]) -> dict:
        """``{(modality, k): (grid row, patch rows)}`` of the repaired items whose samples
        were kept (``drop_inputs``' ``repaired``)."""
        return {key: v for key, v in self.done.items() if sample_of.get(key) in kept}
