"""The Qwen-VL pre-hook's slow path: items from the grid rows, the per-sample report, the plan,
and the repairs solved and resized before the encode (the vision tower is not called here).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ...core.alignment import AlignmentReport, align
from ...core.explain import check_records, plan_records
from ...core.host import to_host
from ...core.items import MediaItem
from ...core.plan import Plan, digest
from ...core.repairs import media_hw, repair_record, solve_allowed
from ...core.runs import ParsedRuns
from ...diagnostics import GuardRecord
from ...errors import MediaInputError
from ...repair.reproject import resize_patches
from .checks import MODALITIES, QwenVLSpec

CALLER = "megatron_media_guard.adapters.qwen_vl"


@dataclass(frozen=True)
class GridRow:
    """One grid row: an image, or a video (its ``runs`` temporal groups on Qwen3-VL)."""

    modality: str
    index: int  # row within its modality's grid
    thw: tuple[int, int, int]
    offset: int  # first row of its patches in that modality's pixel tensor
    features: int
    runs: int

    @property
    def patches(self) -> int:
        return self.thw[0] * self.thw[1] * self.thw[2]


def host_rows(grids: Mapping[str, torch.Tensor | None], spec: QwenVLSpec) -> list[GridRow]:
    """Every grid row, images first, then videos (one transfer for all grids)."""
    parts = [(m, grids[m]) for m in MODALITIES if grids.get(m) is not None]
    if not parts:
        return []
    dev = parts[0][1].device
    flat = torch.cat([g.reshape(-1, 3).to(dev, torch.int64) for _, g in parts])
    # the grid rows, off the aligned path: items, sizes and repairs are planned on the host
    vals = to_host(flat, why="grid rows for diagnosis").tolist()
    rows: list[GridRow] = []
    m2 = spec.merge * spec.merge
    k = 0
    for mod, g in parts:
        offset = 0
        for i in range(g.shape[0]):
            t, h, w = (int(v) for v in vals[k])
            k += 1
            groups = t if mod == "video" and spec.video_runs == "per_group" else 1
            rows.append(GridRow(mod, i, (t, h, w), offset, t * h * w // m2, groups))
            offset += t * h * w
    return rows


def _check_features(meta: Sequence[MediaItem], rows: Sequence[GridRow]) -> None:
    """An item whose declared feature count is not its grid row's (the device check counted
    it; this names it). ``checks.meta_tensors`` already checked the count, the modalities and
    that samples are given for all items or none, when the call started."""
    for i, (it, row) in enumerate(zip(meta, rows)):
        if it.num_features != row.features:
            raise MediaInputError(
                f"item {i} is {it.modality} with {it.num_features} features; grid row "
                f"{row.modality}[{row.index}] {row.thw} gives {row.features}",
                context={"item": i, "grid_thw": list(row.thw)},
            )


def token_items(
    rows: Sequence[GridRow],
    parsed: ParsedRuns,
    spec: QwenVLSpec,
    pixels: Mapping[str, torch.Tensor | None],
    meta: Sequence[MediaItem] | None,
) -> tuple[list[MediaItem], list[int]]:
    """The items as the runs take them, in token order (each modality's items in its own
    order, interleaved as its runs come); returns the items and each item's grid row.
    meta: the caller's items, one per row, as ``checks.meta_tensors`` accepted them."""
    if meta is not None:
        _check_features(meta, rows)
    queues: dict[str, list[tuple[MediaItem, int]]] = {m: [] for m in MODALITIES}
    for r, row in enumerate(rows):
        _, h, w = row.thw
        info = meta[r] if meta is not None else None
        pix = pixels.get(row.modality)
        video = row.modality == "video"
        per = row.patches // row.runs
        for g in range(row.runs):
            thw = row.thw if row.runs == 1 else (1, h, w)
            sl = None
            if pix is not None:
                sl = pix[row.offset + g * per : row.offset + (g + 1) * per]
            item = MediaItem(
                row.features // row.runs,
                sample=None if info is None else info.sample,
                modality=row.modality,
                sample_id=None if info is None else info.sample_id,
                num_frames=thw[0] * spec.temporal_patch if video else None,
                frame_hw=(h * spec.patch, w * spec.patch),
                pixels=sl,
                layout="qwen_patches",
                grid_thw=thw,
                source_hw=None if info is None else info.source_hw,
            )
            queues[row.modality].append((item, r))
    order: list[tuple[MediaItem, int]] = []
    pos = dict.fromkeys(MODALITIES, 0)
    for run in parsed.runs:
        q = queues.get(run.modality)
        if q is not None and pos[run.modality] < len(q):
            order.append(q[pos[run.modality]])
            pos[run.modality] += 1
    for m in MODALITIES:
        order.extend(queues[m][pos[m] :])
    return [it for it, _ in order], [r for _, r in order]


def report_for(parsed: ParsedRuns, items: Sequence[MediaItem]) -> AlignmentReport:
    return align(parsed, items, explicit=any(it.sample is not None for it in items))


@dataclass(frozen=True)
class RowRepair:
    """A grid row re-sized before the encode: its new grid and patches (None without pixels)."""

    row: int
    thw: tuple[int, int, int]
    patches: torch.Tensor | None


def _geometry(geo, modality: str):
    if isinstance(geo, Mapping):
        return geo.get(modality)
    return geo


def _solve_row(guard, geometry, spec, row: GridRow, targets: list[int], item: MediaItem):
    """(new thw, facts) or (None, facts with the reason) for one row's repair."""
    facts: dict = {"target": sum(targets)}
    if len(set(targets)) > 1:
        facts["reason"] = f"the groups of one video need different sizes {targets}"
        return None, facts
    geo = _geometry(geometry, row.modality)
    if geo is None:
        facts["reason"] = f"cannot repair: no geometry for {row.modality}"
        return None, facts
    total = targets[0] * row.runs
    facts["target"] = total
    frames = row.thw[0] * spec.temporal_patch if row.modality == "video" else 1
    hw, kind = media_hw(item)  # a processed frame alone is never an engine replay
    sol, why_not = solve_allowed(geo, total, hw, frames, guard.config, kind)
    facts.update(fidelity=sol.fidelity, size_hw=sol.size_hw, reason=why_not or sol.reason)
    if why_not is not None:
        return None, facts
    ph, pw = sol.size_hw
    thw = (row.thw[0], ph // spec.patch, pw // spec.patch)
    m = spec.merge
    if (
        ph % (spec.patch * m)
        or pw % (spec.patch * m)
        or thw[0] * (thw[1] // m) * (thw[2] // m) != total
    ):
        facts["reason"] = (
            f"the solved size {sol.size_hw} is no grid of {total} features for patch "
            f"{spec.patch}, merge {m} (the geometry's patch/merge differ from the model's)"
        )
        return None, facts
    return thw, facts


def run_row_repairs(
    guard,
    spec: QwenVLSpec,
    plan: Plan,
    rows: Sequence[GridRow],
    items: Sequence[MediaItem],
    item_row: Sequence[int],
    pixels: Mapping[str, torch.Tensor | None],
    *,
    geometry,
    step: int | None,
    microbatch: int | None,
) -> tuple[dict[int, RowRepair], dict[int, str]]:
    """Solves (``geometry``: one, or ``{"image": ..., "video": ...}``) and resizes every row
    the plan repairs; returns the repairs by row and, per sample that must fall back, why.
    Each attempt is written to the per-rank log."""
    want: dict[int, dict[int, int]] = {}  # row -> {token item: target}
    sample_of: dict[int, int] = {}
    for r in plan.repairs:
        want.setdefault(item_row[r.item], {})[r.item] = r.target
        sample_of[item_row[r.item]] = r.sample
    done: dict[int, RowRepair] = {}
    failed: dict[int, str] = {}
    for ri, targets in want.items():
        row = rows[ri]
        t0 = time.perf_counter()
        group_items = [i for i, x in enumerate(item_row) if x == ri]
        per = [targets.get(i, items[i].num_features) for i in group_items]
        first = items[group_items[0]]
        thw, facts = _solve_row(guard, geometry, spec, row, per, first)
        patches = None
        pix = pixels.get(row.modality)
        if thw is not None and pix is not None:
            try:
                src = pix[row.offset : row.offset + row.patches]
                patches, _ = resize_patches(
                    src,
                    row.thw,
                    (thw[1] * spec.patch, thw[2] * spec.patch),
                    patch=spec.patch,
                    temporal_patch=spec.temporal_patch,
                    merge=spec.merge,
                )
            except Exception as exc:  # OOM, shape errors: recorded, then the fallback
                facts["reason"] = f"resize failed: {type(exc).__name__}: {exc}"[:500]
                thw = None
        smp = sample_of[ri]
        if thw is None:
            failed.setdefault(smp, f"{row.modality} grid row {row.index}: {facts.get('reason')}")
        else:
            done[ri] = RowRepair(ri, thw, patches)
        rec = repair_record(
            step=step,
            microbatch=microbatch,
            sample=smp,
            item_index=group_items[0],
            item=first,
            target=facts["target"],
            got=row.features,
            facts=facts,
            ok=thw is not None,
            fallback=guard.config.fallback,
            duration_ms=(time.perf_counter() - t0) * 1e3,
            grid=thw,
            extra={"adapter": "qwen_vl", "grid_row": [row.modality, row.index]}
            | {"grid_thw": list(row.thw)},
        )
        guard.log.emit(rec, caller=CALLER)
    # a sample is repaired only when all of its rows are
    done = {ri: rr for ri, rr in done.items() if sample_of[ri] not in failed}
    return done, failed


def split_rows(
    report: AlignmentReport, item_row: Sequence[int], rows: Sequence[GridRow]
) -> dict[int, str]:
    """Samples fed by a grid row whose runs lie in more than one sample (a Qwen3-VL video's
    temporal groups split between samples), and why. Each run may count right, but one
    video never belongs to two samples: such samples are neither kept nor repaired."""
    by_row: dict[int, set[int]] = {}
    for rep in report.samples:
        for i in rep.items:
            by_row.setdefault(item_row[i], set()).add(rep.sample)
    out: dict[int, str] = {}
    for r, smps in sorted(by_row.items()):
        if len(smps) > 1:
            row = rows[r]
            why = (
                f"{row.modality} grid row {row.index} {row.thw}: its {row.runs} runs fall in "
                f"samples {sorted(smps)}"
            )
            for s in smps:
                out.setdefault(s, why)
    return out


def refuse(plan: Plan, why: Mapping[int, str], config) -> Plan:
    """``plan`` with the samples of ``why`` taking the policy's fallback (never kept or
    repaired), their reasons added."""
    if not why:
        return plan
    act = config.fallback if config.policy == "repair" else config.policy
    actions = [
        act if s in why and a in ("keep", "repair") else a for s, a in enumerate(plan.actions)
    ]
    repairs = [r for r in plan.repairs if r.sample not in why]
    reasons = {**why, **dict(plan.reasons)}
    return Plan(
        tuple(actions),
        tuple(repairs),
        digest(plan.digest, sorted(why.items())),
        tuple(sorted(reasons.items())),
        plan.generated,
    )


def grid_note(rep, items: Sequence[MediaItem], item_row: Sequence[int], rows, spec) -> str:
    """Runs vs grid counts of one sample, for the raise message."""
    parts = []
    for ri in dict.fromkeys(item_row[i] for i in rep.items[:8]):
        row = rows[ri]
        parts.append(
            f"{row.modality} grid row {row.index} thw {row.thw} -> t*h*w/{spec.merge**2} = "
            f"{row.features} features" + (f" in {row.runs} runs" if row.runs > 1 else "")
        )
    return "; ".join(parts)


def plan_call_records(report, plan: Plan, items, notes, step, mb) -> list[GuardRecord]:
    """One record per dropped or raised sample (its grid rows under ``extra.grids``), and for
    unused rows and placeholders in packed padding; core's ``conclude`` writes them."""
    reasons = dict(plan.reasons)

    def aligned(smp: int, act: str) -> GuardRecord:  # a grid row it shares is split or dropped
        why = reasons.get(smp, "a grid row it shares left with a dropped sample")
        rep = report.samples[smp]
        return GuardRecord(
            event=act,
            step=step,
            microbatch=mb,
            sample=smp,
            sample_id=rep.sample_id,
            row=rep.row,
            action=act,
            reason=why,
        )

    out = []
    for smp, _, rec in plan_records(report, plan, items, step, mb, aligned):
        extra = {**(rec.extra or {}), "adapter": "qwen_vl", "grids": notes.get(smp)}
        out.append(replace(rec, extra=extra))
    orphans = "grid rows of items {} have no placeholder run"
    for rec in check_records(report, step, mb, orphans):  # padding placeholders: made text
        out.append(replace(rec, extra={"adapter": "qwen_vl"}))
    return out


def check_record(guard, step, mb, action: str, reason: str) -> None:
    """A ``check`` record of the adapter: inputs put right without deciding for any sample."""
    rec = GuardRecord(
        event="check",
        step=step,
        microbatch=mb,
        action=action,
        reason=reason,
        extra={"adapter": "qwen_vl"},
    )
    guard.log.emit(rec, caller=CALLER)
