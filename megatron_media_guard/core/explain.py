"""Turning alignment facts into diagnostic records and error messages (no tensors here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from ..diagnostics import GuardRecord, summary_line
from ..diagnostics.records import json_safe
from .alignment import AlignmentReport, SampleReport
from .generated import Generated
from .items import MediaItem

if TYPE_CHECKING:
    from .plan import Plan


def sample_record(
    rep: SampleReport,
    items: Sequence[MediaItem],
    action: str,
    *,
    step: int | None,
    microbatch: int | None,
    nonfinite: Sequence[int] | None = None,
) -> GuardRecord:
    """One record (event and action ``action``) for a mismatched sample (``item``: the first
    mismatching one, else its first), or for one whose features hold NaN/Inf (``nonfinite``:
    its items that do; ``item``: the first of them)."""
    k = rep.first_mismatch if rep.first_mismatch is not None else 0
    idx = rep.items[k] if k < len(rep.items) else (rep.items[0] if rep.items else None)
    reason = f"{rep.status}: {rep.reason}"
    extra = {"status": str(rep.status), "findings": [f.in_sample() for f in rep.findings[:8]]}
    if nonfinite is not None:
        which = ", ".join(map(str, nonfinite[:8])) + (" ..." if len(nonfinite) > 8 else "")
        noun = "item" if len(nonfinite) == 1 else "items"
        reason = f"nonfinite: NaN/Inf in the features of {noun} {which}"
        extra = {"status": "nonfinite"}
        if nonfinite:
            idx, extra["items"] = nonfinite[0], list(nonfinite[:16])
    item = None if idx is None else items[idx]
    return GuardRecord(
        event=action,  # type: ignore[arg-type]
        step=step,
        microbatch=microbatch,
        sample=rep.sample,
        sample_id=rep.sample_id,
        row=rep.row,
        item=idx,
        modality=item.modality if item else (rep.run_modalities[0] if rep.run_modalities else None),
        expected=rep.expected,
        got=rep.got,
        first_mismatch=None if nonfinite else rep.first_mismatch,
        num_frames=item.num_frames if item else None,
        frame_hw=item.frame_hw if item else None,
        grid=item.grid_thw if item else None,
        action=action,
        reason=reason,
        extra=extra,
    )


def alignment_message(
    where: str,
    records: Sequence[Mapping[str, object] | GuardRecord],
    *,
    total: int,
    summary: str,
    what: str | None = None,
    unit: str = "samples",
    log_path: str | None = None,
    bundle: object | None = None,
) -> str:
    """The raise message of a call from the records it wrote: where, what was guarded and how
    many of its ``total`` ``unit`` raise, one ``summary_line`` per ``raise`` record (eight at
    most), the batch's ``summary``, the log and the bundle. Never raises (a shorter message
    takes its place: the alignment error must come out)."""
    try:
        # a record not written: as the log would write it
        recs = [r if isinstance(r, Mapping) else json_safe(asdict(r)) for r in records]
        raised = [r for r in recs if r.get("event") == "raise"]
        samples = len({r.get("sample") for r in raised if r.get("sample") is not None})
        batch = sum(1 for r in raised if r.get("sample") is None)
        head = f"Media alignment failed ({where}): " + (f"{what}, " if what else "")
        head += f"{samples} of {total} {unit}"
        head += f" and {batch} batch-level problem(s):" if batch else ":"
        lines = [head] + ["  " + summary_line(r, where=False) for r in raised[:8]]
        if len(raised) > 8:
            lines.append(f"  ... and {len(raised) - 8} more (the per-rank log has them all)")
        lines.append(f"  batch: {summary}")
    except Exception as err:
        lines = [
            f"Media alignment failed ({where}) (the full message could not be built: "
            f"{type(err).__name__})"
        ]
    if log_path:
        lines.append(f"  per-rank log: {log_path}")
    if bundle is not None:
        lines.append(f"  replay bundle: {bundle}")
    return "\n".join(lines)


def batch_summary(report: AlignmentReport) -> str:
    """The totals line of a parsed call's message."""
    return (
        f"{report.num_runs} runs / {report.num_items} items, "
        f"{report.total_placeholders} placeholders / {report.total_features} features"
    )


def plan_records(
    report: AlignmentReport,
    plan: Plan,
    items: Sequence[MediaItem],
    step: int | None,
    microbatch: int | None,
    *,
    nonfinite: Mapping[int, Sequence[int]],
    gen: Generated | None,
    failed: Mapping[int, str],
) -> list[GuardRecord]:
    """One record per dropped or raised sample, in sample order: a mismatched one by its runs;
    an aligned one by its generated placeholders (``gen``), its items holding NaN/Inf
    (``nonfinite``: sample -> items) or, with neither, the plan's reason for the whole call.
    The plan's reason comes first, why its repair failed (``failed``) before it."""
    reasons = dict(plan.reasons)
    out = []
    for smp, act in enumerate(plan.actions):
        if act not in ("drop", "raise"):
            continue
        rep, why, bad = report.samples[smp], reasons.get(smp), nonfinite.get(smp, [])
        fed = None if gen is None or bad else gen.of(smp)
        if not rep.ok:
            rec = sample_record(rep, items, act, step=step, microbatch=microbatch)
        elif bad or not (why or fed):
            rec = sample_record(rep, items, act, step=step, microbatch=microbatch, nonfinite=bad)
        else:  # aligned: its generated placeholders, or the whole call's findings: no item
            rec = GuardRecord(
                event=act,  # type: ignore[arg-type]
                step=step,
                microbatch=microbatch,
                sample=smp,
                sample_id=rep.sample_id,
                row=rep.row,
                action=act,  # type: ignore[arg-type]
                reason=gen.reasons(act)[smp] if fed else None,
                extra={"status": "generated", "positions": list(fed.positions[:4096])}
                if fed
                else {"status": "call"},
            )
        if why and why not in (rec.reason or ""):
            rec = replace(rec, reason=f"{why}; {rec.reason}" if rec.reason else why)
        if smp in failed:
            rec = replace(rec, reason=f"{failed[smp]}; {rec.reason}")
        out.append(rec)
    return out


def check_records(
    report: AlignmentReport, step: int | None, microbatch: int | None
) -> list[GuardRecord]:
    """``check`` records of items tied to no run and of placeholders in a packed row's
    padding (never merged)."""
    orphans = list(report.orphans)[:16]
    found = [
        ("unused", f"items {orphans} could not be tied to a placeholder run" if orphans else ""),
        ("ignored", "; ".join(f.describe() for f in report.stray_findings[:4])),
    ]
    return [
        GuardRecord(event="check", step=step, microbatch=microbatch, action=act, reason=why)
        for act, why in found
        if why
    ]
