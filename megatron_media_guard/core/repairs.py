"""Policy ``repair``: re-project the items a plan names; a sample is repaired when all of its
items are, else it takes ``config.fallback``. Every attempt is a ``repair`` record."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..config import GuardConfig
from ..diagnostics import GuardRecord
from ..geometry import HwKind
from ..repair.fp8 import fp8_multiple
from ..repair.reproject import reencode
from .items import Batch, MediaItem
from .plan import ItemRepair, Plan


@dataclass(frozen=True)
class RepairContext:
    """What a repair may use: the geometry and the config; nothing else of the guard."""

    geometry: Any
    config: GuardConfig
    family: str = "this grammar"  # named when there is no geometry to repair with


@dataclass(frozen=True)
class RepairOutcome:
    """The plan after fallbacks, new features by item, why each failed sample fell back, and
    one ``repair`` record per attempt for the caller to write."""

    plan: Plan
    replaced: dict[int, torch.Tensor]
    failures: dict[int, str]
    records: tuple[GuardRecord, ...]


def media_hw(item: MediaItem) -> tuple[tuple[int, int] | None, HwKind]:
    """The size a repair solves from: ``source_hw`` ("source"), else a frame the processor
    already resized ("frame": never an engine replay)."""
    if item.source_hw is not None:
        return item.source_hw, "source"
    if item.frame_hw is not None:
        return item.frame_hw, "frame"
    if item.pixels is not None and item.layout == "image" and item.pixels.dim() in (3, 4):
        return (int(item.pixels.shape[-2]), int(item.pixels.shape[-1])), "frame"
    return None, "frame"


def solve_allowed(
    geo, target: int, hw: tuple[int, int], num_frames: int, config, hw_kind: HwKind = "source"
):
    """``(solution, None)`` when ``geo`` reaches ``target`` at an allowed fidelity, else
    ``(solution, why not)``."""
    sol = geo.solve(target, hw, num_frames=num_frames, hw_kind=hw_kind)
    if not sol.reachable:
        return sol, f"unreachable: {sol.reason}"
    if sol.fidelity not in config.allowed_fidelity:
        allowed = list(config.allowed_fidelity)
        return sol, f"fidelity {sol.fidelity} not allowed (allowed: {allowed}): {sol.reason}"
    return sol, None


def _attempt(
    r: ItemRepair, plan: Plan, batch: Batch, ctx: RepairContext, encoder
) -> tuple[torch.Tensor | None, dict]:
    """``(features or None, facts for the record)`` (``encoder.reprocess`` where it has one)."""
    redo = getattr(encoder, "reprocess", None)
    if redo is not None:
        return redo(r, plan, batch, ctx)
    item = batch.items[r.item]
    facts: dict = {"target": r.target}
    hw, hw_kind = media_hw(item)
    if ctx.geometry is None:  # the family has no sizing to repair with
        return None, facts | {"reason": f"cannot repair: no geometry for {ctx.family}"}
    what = (("encoder", encoder), ("pixels", item.pixels), ("media size", hw))
    missing = [name for name, v in what if v is None]
    if missing:
        return None, facts | {"reason": f"cannot repair: no {', '.join(missing)} given"}
    geo = ctx.geometry
    sol, why_not = solve_allowed(geo, r.target, hw, item.num_frames or 1, ctx.config, hw_kind)
    facts.update(fidelity=sol.fidelity, grid=getattr(sol, "grid", None), size_hw=sol.size_hw)
    if why_not is not None:
        return None, facts | {"reason": why_not}
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
            fp8_multiple=fp8_multiple(ctx.config.fp8, ctx.config.fp8_multiple),
            **kwargs,
        )
    except Exception as exc:  # OOM, shape errors in the user's encoder: recorded, then fallback
        why = f"re-encoding failed: {type(exc).__name__}: {exc}"[:500]
        return None, facts | {"reason": why, "error_type": type(exc).__name__}
    f = res.features
    want = batch.features
    if f.shape[0] != r.target:  # a geometry that broke its Solution contract
        why = (
            f"re-encoding gave {f.shape[0]} features for {r.target} placeholders "
            f"(solution claimed {sol.tokens})"
        )
    elif f.dtype != want.dtype or f.device != want.device or f.shape[1] != want.shape[1]:
        why = (
            f"re-encoded features are {f.dtype} [{f.shape[1]}] on {f.device}, the batch's "
            f"{want.dtype} [{want.shape[1]}] on {want.device}"
        )
    else:
        return f, facts | {"grid": res.grid, "size_hw": res.size_hw, "reason": sol.reason}
    return None, facts | {"reason": why}


def run_repairs(
    plan: Plan,
    batch: Batch,
    ctx: RepairContext,
    encoder,
    *,
    step: int | None,
    microbatch: int | None,
) -> RepairOutcome:
    """Attempts every repair of ``plan`` (the module docstring)."""
    done: dict[int, torch.Tensor] = {}
    failed: dict[int, str] = {}
    records: list[GuardRecord] = []
    for r in plan.repairs:
        t0 = time.perf_counter()
        feats, facts = _attempt(r, plan, batch, ctx, encoder)
        item = batch.items[r.item]
        ok = feats is not None
        if ok:
            done[r.item] = feats
        else:
            failed.setdefault(r.sample, f"item {r.item}: {facts.get('reason')}")
        size, grid = facts.get("size_hw"), facts.get("grid")
        records.append(
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
                grid=tuple(grid) if grid else None,
                action="repair" if ok else f"fallback:{ctx.config.fallback}",
                fidelity=facts.get("fidelity"),
                reason=facts.get("reason"),
                duration_ms=(time.perf_counter() - t0) * 1e3,
                extra={"size_hw": list(size) if size else None},
            )
        )
    actions = [ctx.config.fallback if s in failed else a for s, a in enumerate(plan.actions)]
    kept = [r for r in plan.repairs if r.sample not in failed]
    replaced = {r.item: done[r.item] for r in kept}
    return RepairOutcome(plan.with_actions(actions, kept), replaced, failed, tuple(records))


def warn_unrepairable(encoder: object | None, fallback: str) -> None:
    """``policy="repair"`` without a geometry: said once, when the guard is built."""
    missing = "geometry" if encoder is not None else "geometry and encoder"
    warnings.warn(
        f"MediaGuard(policy='repair') without {missing}: no mismatch can be "
        f"repaired, each one takes the fallback ({fallback!r}). Pass geometry= (and encoder=, "
        "here or to each merge), or install the guard with install_vlm, which builds both "
        "from the model where its family has them",
        UserWarning,
        stacklevel=3,
    )
