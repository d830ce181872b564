"""Repair in the ``inputs`` mode, before the model's one tower call: :class:`Resizer`, the
guard's ``encoder``, resizes a mismatched item's patch rows (``ModalitySpec.patches``) to the
grid the geometry solves for its runs, for the input rewrite (:func:`~.inputs.drop_inputs`'
``repaired``); the model's own forward encodes them, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import torch

from ..core.host import to_host
from ..core.items import MediaItem
from ..core.plan import ItemRepair, Plan
from ..core.repairs import media_hw, solve_allowed
from ..errors import MediaAlignmentError
from ..repair.reproject import resize_patches
from .reprocess import ItemRepairer, Key
from .spec import ModalitySpec


class Resizer(ItemRepairer):
    """The planned repairs of one call (:class:`~.reprocess.ItemRepairer`); split: why an item
    whose runs lie in several samples is refused."""

    verb = "resizing"

    def __init__(
        self,
        mods: Sequence[ModalitySpec],
        items: Sequence[MediaItem],
        parent: Sequence[int],
        inputs: Mapping[str, Any],
        geometry: Any,
        split: Mapping[Key, str] | None = None,
    ) -> None:
        super().__init__(items, parent, geometry)
        self.mods = {m.name: m for m in mods}
        self.inputs = inputs
        self.split = dict(split or {})
        self._offsets: dict[str, list[int]] = {}

    def again(self, key: Key, r: ItemRepair, facts: dict) -> torch.Tensor:
        facts.update(grid=self.done[key][0], reason="resized with its video's other runs")
        return torch.empty(r.target, 0)

    def solve(self, key: Key, r: ItemRepair, plan: Plan, batch, item, ctx, facts: dict):
        """The item's runs resized together (zero-width rows: the model encodes them)."""
        mod, k = key
        if key in self.split:
            raise MediaAlignmentError(f"cannot repair: {self.split[key]}")
        geo = self.geometry_of(mod)
        if geo is None:
            raise MediaAlignmentError(f"cannot repair: no geometry for {mod}")
        want = set(self.targets(key, plan, batch))
        if len(want) > 1:
            raise MediaAlignmentError(
                f"cannot repair: the runs of {mod} {k} ask for sizes {sorted(want)}"
            )
        total = r.target * len(self.runs[key])
        thw0 = item.grid_thw
        if thw0 is None:
            raise MediaAlignmentError(f"cannot repair: no grid for {mod} {k}")
        p, m, tp = geo.patch, geo.merge, getattr(geo, "temporal_patch", 1) or 1
        frames = thw0[0] * tp if mod == "video" else 1
        hw, kind = media_hw(item)
        sol, why_not = solve_allowed(geo, total, hw, frames, ctx.config, kind)
        facts.update(fidelity=sol.fidelity, size_hw=sol.size_hw, reason=sol.reason)
        if why_not is not None:
            raise MediaAlignmentError(why_not)
        ph, pw = sol.size_hw
        thw = (thw0[0], ph // p, pw // p)
        if ph % (p * m) or pw % (p * m) or thw[0] * (thw[1] // m) * (thw[2] // m) != total:
            raise MediaAlignmentError(
                f"the solved size {sol.size_hw} is no grid of {total} features for patch {p}, "
                f"merge {m} (the geometry's patch/merge differ from the model's)"
            )
        patches = None
        for name in self.mods[mod].patches:
            x = self.inputs.get(name)
            if isinstance(x, torch.Tensor):
                off = self._offset(mod, name)
                src = x[off[k] : off[k + 1]]
                patches, _ = resize_patches(
                    src, thw0, (ph, pw), patch=p, temporal_patch=tp, merge=m
                )
        self.done[key] = (thw, patches)
        facts["grid"] = thw
        return torch.empty(r.target, 0)

    def _offset(self, mod: str, name: str) -> list[int]:
        """The first patch row of each model-level item in ``name`` (its grid on the host:
        one transfer, repairs only)."""
        if name not in self._offsets:
            grid = self.inputs[self.mods[mod].patches[name]]
            rows = to_host(grid.long().prod(-1), why="patch rows per item to repair").tolist()
            self._offsets[name] = list(accumulate(rows, initial=0))
        return self._offsets[name]
