"""The data side's repair in :func:`~.collate.check_batch` (docs/DATA_SIDE.md): each
mismatched item re-processed from its original media at the run's length solved with the
family's geometry, as the family's processor does (:mod:`.pinning`), refused unless the result
has exactly the run's length (nothing inferred; a refusal takes ``GuardConfig.fallback``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.items import MediaItem
from ..core.outcome import GuardReport
from ..core.plan import ItemRepair, Plan
from ..core.repairs import solve_allowed
from ..errors import MediaAlignmentError, MediaInputError
from .pinning import PINS, PatchMergeVideoPin, Processed, as_channels_first, as_frames
from .spec import FamilySpec

#: a refusal's verdict, first in its reason (the one-line record keeps 200 characters)
UNDETERMINED = (
    "the run's length does not uniquely determine an input the processor maps to it "
    "(refused, no grid inferred)"
)

Key = tuple[str, int]  # (modality, model-level index)


@dataclass(frozen=True)
class Reprocessed:
    """One item re-processed from its original at the rollout's run. index: its row in the
    modality's grid input; tokens: its runs' total; size_hw: the (frame) size processed at;
    how: ``pinned`` (budget ``knobs``), ``resized`` or ``own-arithmetic``; duration_ms: solve
    and process, host wall time."""

    modality: str
    index: int
    sample: int
    tokens: int
    fidelity: str
    size_hw: tuple[int, int]
    grid: tuple[int, ...]
    how: str
    knobs: tuple[tuple[str, int], ...]
    duration_ms: float
    rows: torch.Tensor = field(compare=False, repr=False)


def originals(media: Any, keys: Sequence[Key]) -> dict[Key, Any]:
    """``media`` by item: a sequence with one original per model-level item in ``keys``' order
    (every image, then every video, ...; None where there is none), or a mapping modality ->
    its originals in order."""
    if isinstance(media, Mapping):
        return {(mod, k): m for mod, seq in media.items() for k, m in enumerate(seq)}
    media = list(media)
    if len(media) != len(keys):
        raise MediaInputError(
            f"check_batch(media=...) has {len(media)} originals for {len(keys)} media items "
            f"({', '.join(f'{m} {k}' for m, k in keys)}): pass one per item in that order "
            "(None where there is none), or a dict modality -> list"
        )
    return dict(zip(keys, media))


class ItemRepairer:
    """The guard's ``encoder`` for one call's planned repairs (``core.repairs``' hook): each
    model-level item ``(modality, k)`` solved once, whole (a video with all of its runs), its
    other runs given the same result; a refusal recorded for them too. ``parent``: per item
    (one per run) its model-level index; ``geometry``: one, or ``{modality: geometry}``.
    Subclasses :meth:`solve` an item (raising ``MediaAlignmentError`` to refuse) and say what
    a solved item's other runs get (:meth:`again`)."""

    def __init__(self, items: Sequence[MediaItem], parent: Sequence[int], geometry: Any) -> None:
        self.geometry = geometry
        self.key = {id(it): (it.modality, k) for it, k in zip(items, parent)}
        self.runs: dict[Key, list[MediaItem]] = {}
        for it, k in zip(items, parent):
            self.runs.setdefault((it.modality, k), []).append(it)
        self.done: dict[Key, Any] = {}
        self.sample: dict[Key, int] = {}
        self.failed: dict[Key, str] = {}

    def reprocess(self, r: ItemRepair, plan: Plan, batch, ctx) -> tuple[Any, dict]:
        """One planned repair: (new rows or None, facts for the record)."""
        t0 = time.perf_counter()
        item = batch.items[r.item]
        key = self.key.get(id(item))
        facts: dict = {"target": r.target}
        if key in self.done:
            return self.again(key, r, facts), facts
        if key in self.failed:
            facts["reason"] = self.failed[key]
            return None, facts
        try:
            if key is None:
                raise MediaAlignmentError("cannot repair: the item is not one of the call's")
            rows = self.solve(key, r, plan, batch, item, ctx, facts)
            self.sample[key] = r.sample
        except Exception as err:
            if isinstance(err, MediaAlignmentError):
                facts["reason"] = str(err)
            else:  # a geometry's, converter's or processor's own error: recorded, fallback
                what = f"{key[0]} {key[1]} " if key else ""
                why = f"{self.verb} {what}failed: {type(err).__name__}: {err}"
                facts["reason"] = why[:500]
            if key is not None:
                self.failed[key] = facts["reason"]
            return None, facts
        facts["duration_ms"] = (time.perf_counter() - t0) * 1e3
        return rows, facts

    verb = "repairing"  # what an unexpected error's reason says failed

    def geometry_of(self, mod: str) -> Any:
        geo = self.geometry
        return geo.get(mod) if isinstance(geo, Mapping) else geo  # a geometry per modality

    def targets(self, key: Key, plan: Plan, batch) -> list[int]:
        """What each run of ``key`` must hold, in order: its planned target, else its count."""
        want = {id(batch.items[x.item]): x.target for x in plan.repairs}
        return [want.get(id(it), it.num_features) for it in self.runs[key]]

    def kept(self, report: GuardReport) -> dict[Key, Any]:
        """The solved items whose samples the plan kept repaired."""
        keep = {s for s, a in enumerate(report.actions) if a == "repair"}
        return {key: d for key, d in self.done.items() if self.sample[key] in keep}


class Reprocessor(ItemRepairer):
    """The guard's ``encoder`` in ``check_batch`` (module docstring); ``media``: see
    :func:`originals`."""

    verb = "re-processing"

    def __init__(
        self,
        spec: FamilySpec,
        geometry: Any,
        items: Sequence[MediaItem],
        parent: Sequence[int],
        media: Any,
        processor: Any = None,
    ) -> None:
        super().__init__(items, parent, geometry)
        self.spec, self.processor = spec, processor
        # the originals come per modality in the spec's order, the items in token order
        rank = {m.name: i for i, m in enumerate(spec.modalities)}
        self.media = originals(media, sorted(self.runs, key=lambda k: (rank[k[0]], k[1])))

    def _processor(self, mod: str) -> Any:
        """The processor for ``mod``: ``processor[mod]`` of a mapping, else the one given
        (images only: a video needs its video processor)."""
        if isinstance(self.processor, Mapping):
            return self.processor.get(mod)
        return self.processor if mod == "image" else None

    def again(self, key: Key, r: ItemRepair, facts: dict) -> torch.Tensor:
        d = self.done[key]  # another run of a video already re-processed whole
        facts.update(fidelity=d.fidelity, size_hw=d.size_hw, grid=d.grid)
        facts["reason"] = f"re-processed from the original with its video ({d.how})"
        return d.rows

    def solve(self, key: Key, r: ItemRepair, plan: Plan, batch, item, ctx, facts: dict):
        t0 = time.perf_counter()
        mod, k = key
        if self.media.get(key) is None:
            raise MediaAlignmentError("cannot repair: no original media given for this item")
        if mod not in ("image", "video"):
            raise MediaAlignmentError(f"cannot repair: {mod} items are not re-processed here")
        solved = self._video if mod == "video" else self._image
        sol, proc, tokens = solved(r, plan, batch, key, ctx, facts)
        facts.update(
            fidelity=sol.fidelity,
            size_hw=sol.size_hw,
            grid=proc.grid,
            reason=f"re-processed from the original ({proc.how}): {sol.reason}",
        )
        when = (time.perf_counter() - t0) * 1e3
        self.done[key] = Reprocessed(
            mod,
            k,
            r.sample,
            tokens,
            sol.fidelity,
            tuple(sol.size_hw),
            proc.grid,
            proc.how,
            proc.knobs,
            when,
            proc.rows,
        )
        return proc.rows

    def _image(self, r: ItemRepair, plan: Plan, batch, key: Key, ctx, facts):
        mod, k = key
        pin, geo = PINS.get((self.spec.name, mod)), self.geometry_of(mod)
        if pin is None or geo is None:
            what = "its processor has no pin" if pin is None else "it has no geometry"
            raise MediaAlignmentError(
                f"cannot repair: {self.spec.name} images are not re-processed from the "
                f"original here ({what})"
            )
        original = self.media[key]
        hw = tuple(as_channels_first(original).shape[-2:])
        sol, why_not = solve_allowed(geo, r.target, hw, 1, ctx.config)
        facts.update(fidelity=sol.fidelity, size_hw=sol.size_hw)
        if why_not is not None:
            raise MediaAlignmentError(f"{mod} {k} ({hw[0]}x{hw[1]}): {why_not}")
        proc: Processed = pin.run(self._processor(mod), original, sol)
        if proc.tokens != r.target:
            # the verdict first: the one-line record keeps a reason's first 200 characters
            raise MediaAlignmentError(
                f"{UNDETERMINED}: {mod} {k} ({hw[0]}x{hw[1]}): the processor gives "
                f"{proc.tokens} tokens for a run of {r.target} (grid {list(proc.grid)}, "
                f"{proc.how}"
                + (f" with {dict(proc.knobs)}" if proc.knobs else f" at {sol.size_hw}")
                + ")"
            )
        return sol, proc, r.target

    def _video(self, r: ItemRepair, plan: Plan, batch, key: Key, ctx, facts):
        """A video solved and processed whole from its frames, pinned to all of its runs."""
        mod, k = key
        static = [it.num_features for it in self.runs[key]]  # as the static processing gave
        rollout = self.targets(key, plan, batch)
        pin, geo = PINS.get((self.spec.name, mod)), self.geometry_of(mod)
        if not isinstance(pin, PatchMergeVideoPin) or geo is None:  # totals, first run, why
            why = pin if isinstance(pin, str) else f"{self.spec.name} has no video pin"
            first = next((i for i, (a, b) in enumerate(zip(static, rollout)) if a != b), 0)
            original = self.media[key]
            frames = len(original) if hasattr(original, "__len__") else "?"
            raise MediaAlignmentError(
                f"{mod} {k} ({frames} frames): the static processing gives {sum(static)} "
                f"placeholders in {len(static)} run(s), the rollout {sum(rollout)}; first "
                f"mismatching run: {first} ({static[first]} vs {rollout[first]}); refused, no "
                f"grid inferred: {why}"
            )
        sizes = {n: int(getattr(geo, n)) for n in ("patch", "merge", "temporal_patch")}
        frames = as_frames(self.media[key])
        t, hw = frames.shape[0], tuple(frames.shape[-2:])
        groups = -(-t // sizes["temporal_patch"])
        what = f"{mod} {k} ({t} frames, {hw[0]}x{hw[1]})"

        def refused(detail: str) -> MediaAlignmentError:
            return MediaAlignmentError(f"{UNDETERMINED}: {what}, rollout runs {rollout}: {detail}")

        per_group = len(static) > 1  # the family counts a run per temporal group
        if per_group and len(rollout) != groups:
            raise refused(
                f"its frames make {groups} temporal groups of {sizes['temporal_patch']} frames, "
                f"one run each, the rollout wrote {len(rollout)} runs"
            )
        if per_group and len(set(rollout)) != 1:
            raise refused("one frame size gives every temporal group the same run")
        total = sum(rollout)
        sol, why_not = solve_allowed(geo, total, hw, t, ctx.config)
        facts.update(fidelity=sol.fidelity, size_hw=sol.size_hw)
        if why_not is not None:
            raise refused(why_not)
        proc = pin.run(self._processor(mod), frames, sol, sizes)
        _, gh, gw = proc.grid
        cell = gh * gw // (sizes["merge"] ** 2)
        got = [cell] * (proc.tokens // cell) if per_group else [proc.tokens]
        if got != rollout:
            raise refused(
                f"the processor gives runs {got} (grid {list(proc.grid)}, {proc.how} at "
                f"{sol.size_hw})"
            )
        return sol, proc, total
