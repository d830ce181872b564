"""Policy ``repair``: re-project the mismatched items of a plan, falling back per sample.

Only the items the plan names are re-encoded. A sample is repaired when every one of
its items is; otherwise the whole sample takes ``config.fallback`` (drop or raise).
Every attempt is written to the per-rank log with target, size, fidelity and duration.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..core.items import Batch, MediaItem
from ..core.plan import ItemRepair, Plan
from ..diagnostics import GuardRecord
from .fp8 import fp8_multiple
from .reproject import reencode

if TYPE_CHECKING:
    from ..core.guard import MediaGuard


def _source_hw(item: MediaItem) -> tuple[int, int] | None:
    if item.source_hw is not None:
        return item.source_hw
    if item.frame_hw is not None:
        return item.frame_hw
    if item.pixels is not None and item.layout == "image" and item.pixels.dim() in (3, 4):
        return int(item.pixels.shape[-2]), int(item.pixels.shape[-1])
    return None


def solve_allowed(geo, target: int, hw: tuple[int, int], num_frames: int, config):
    """``(solution, None)`` when ``geo`` reaches ``target`` at a fidelity ``config`` allows, else
    ``(solution, why not)``."""
    sol = geo.solve(target, hw, num_frames=num_frames)
    if not sol.reachable:
        return sol, f"unreachable: {sol.reason}"
    if sol.fidelity not in config.allowed_fidelity:
        allowed = list(config.allowed_fidelity)
        return sol, f"fidelity {sol.fidelity} not allowed (allowed: {allowed}): {sol.reason}"
    return sol, None


def _attempt(
    r: ItemRepair, batch: Batch, guard: MediaGuard, encoder
) -> tuple[torch.Tensor | None, dict]:
    """Re-encode one item; returns (features or None, facts for the record)."""
    item = batch.items[r.item]
    facts: dict = {"target": r.target}
    hw = _source_hw(item)
    if guard.geometry is None:  # the family's sizing is not known: say which family
        facts["reason"] = f"cannot repair: no geometry for {guard.grammar.name}"
        return None, facts
    missing = [
        name
        for name, v in (
            ("encoder", encoder),
            ("geometry", guard.geometry),
            ("pixels", item.pixels),
            ("media size", hw),
        )
        if v is None
    ]
    if missing:
        facts["reason"] = f"cannot repair: no {', '.join(missing)} given"
        return None, facts
    geo = guard.geometry
    sol, why_not = solve_allowed(geo, r.target, hw, item.num_frames or 1, guard.config)
    facts.update(fidelity=sol.fidelity, grid=getattr(sol, "grid", None), size_hw=sol.size_hw)
    if why_not is not None:
        facts["reason"] = why_not
        return None, facts
    kwargs = {
        k: getattr(geo, k)
        for k in ("patch", "temporal_patch", "merge")
        if isinstance(getattr(geo, k, None), int)
    }
    try:
        res = reencode(
            item.pixels,
            item.layout,
            sol,
            encoder,
            grid_thw=item.grid_thw,
            fp8_multiple=fp8_multiple(guard.config.fp8, guard.config.fp8_multiple),
            **kwargs,
        )
    except Exception as exc:  # OOM, shape errors in the user's encoder: recorded, then fallback
        facts["reason"] = f"re-encoding failed: {type(exc).__name__}: {exc}"[:500]
        facts["error_type"] = type(exc).__name__
        return None, facts
    f = res.features
    if f.shape[0] != r.target:  # a geometry that broke its Solution contract
        facts["reason"] = (
            f"re-encoding gave {f.shape[0]} features for {r.target} placeholders "
            f"(solution claimed {sol.tokens})"
        )
        return None, facts
    want = batch.features
    if f.dtype != want.dtype or f.device != want.device or f.shape[1] != want.shape[1]:
        facts["reason"] = (
            f"re-encoded features are {f.dtype} [{f.shape[1]}] on {f.device}, the batch's "
            f"{want.dtype} [{want.shape[1]}] on {want.device}"
        )
        return None, facts
    facts.update(grid=res.grid, size_hw=res.size_hw, reason=sol.reason)
    return f, facts


def run_repairs(
    plan: Plan,
    batch: Batch,
    guard: MediaGuard,
    encoder,
    *,
    step: int | None,
    microbatch: int | None,
) -> tuple[Plan, dict[int, torch.Tensor], dict[int, str]]:
    """Attempts every repair of ``plan``; returns the plan after fallbacks, the new features
    by item index (only for samples whose every repair succeeded) and, per sample that fell
    back, why its first failed repair failed."""
    done: dict[int, torch.Tensor] = {}
    failed: dict[int, str] = {}
    for r in plan.repairs:
        t0 = time.perf_counter()
        feats, facts = _attempt(r, batch, guard, encoder)
        ms = (time.perf_counter() - t0) * 1e3
        item = batch.items[r.item]
        ok = feats is not None
        if ok:
            done[r.item] = feats
        else:
            failed.setdefault(r.sample, f"item {r.item}: {facts.get('reason')}")
        guard.log.emit(
            GuardRecord(
                event="repair",
                step=step,
                microbatch=microbatch,
                sample=r.sample,
                sample_id=item.sample_id,
                item=r.item,
                modality=item.modality,
                expected=(r.target,),
                got=(item.num_features,),
                first_mismatch=r.run,
                num_frames=item.num_frames,
                frame_hw=item.frame_hw,
                grid=tuple(facts["grid"]) if facts.get("grid") else None,
                action="repair" if ok else f"fallback:{guard.config.fallback}",
                fidelity=facts.get("fidelity"),
                reason=facts.get("reason"),
                duration_ms=ms,
                extra={"size_hw": list(facts["size_hw"]) if facts.get("size_hw") else None},
            )
        )
    actions = [guard.config.fallback if s in failed else a for s, a in enumerate(plan.actions)]
    kept = [r for r in plan.repairs if r.sample not in failed]
    replaced = {r.item: done[r.item] for r in kept}
    return plan.with_actions(actions, kept), replaced, failed
