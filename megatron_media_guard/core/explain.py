"""Turning alignment facts into diagnostic records and error messages (no tensors here)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..diagnostics import GuardRecord
from .alignment import AlignmentReport, SampleReport
from .items import MediaItem

if TYPE_CHECKING:
    from .plan import Plan


def _item_of(rep: SampleReport, items: Sequence[MediaItem]) -> tuple[int | None, MediaItem | None]:
    k = rep.first_mismatch
    if k is not None and k < len(rep.items):
        i = rep.items[k]
        return i, items[i]
    if rep.items:
        return rep.items[0], items[rep.items[0]]
    return None, None


def sample_record(
    rep: SampleReport,
    items: Sequence[MediaItem],
    event: str,
    action: str,
    *,
    step: int | None,
    microbatch: int | None,
) -> GuardRecord:
    """One record for a mismatched sample; ``item`` is the first mismatching one."""
    idx, item = _item_of(rep, items)
    return GuardRecord(
        event=event,  # type: ignore[arg-type]
        step=step,
        microbatch=microbatch,
        sample=rep.sample,
        sample_id=rep.sample_id,
        row=rep.row,
        item=idx,
        modality=item.modality if item else (rep.run_modalities[0] if rep.run_modalities else None),
        expected=rep.expected,
        got=rep.got,
        first_mismatch=rep.first_mismatch,
        num_frames=item.num_frames if item else None,
        frame_hw=item.frame_hw if item else None,
        grid=item.grid_thw if item else None,
        action=action,
        reason=f"{rep.status}: {rep.reason}",
        extra={"status": str(rep.status), "findings": [f.describe() for f in rep.findings[:8]]},
    )


def nonfinite_record(
    rep: SampleReport,
    items: Sequence[MediaItem],
    bad_items: Sequence[int],
    event: str,
    *,
    step: int | None,
    microbatch: int | None,
) -> GuardRecord:
    """The record of a sample whose tokens align but whose features hold NaN/Inf:
    ``reason`` starts with ``nonfinite``, ``item`` is the first such item."""
    rec = sample_record(rep, items, event, event, step=step, microbatch=microbatch)
    if not bad_items:
        return replace(rec, reason=nonfinite_reason(bad_items), extra={"status": "nonfinite"})
    item = items[bad_items[0]]
    return replace(
        rec,
        item=bad_items[0],
        modality=item.modality,
        num_frames=item.num_frames,
        frame_hw=item.frame_hw,
        first_mismatch=None,
        reason=nonfinite_reason(bad_items),
        extra={"status": "nonfinite", "items": list(bad_items[:16])},
    )


def nonfinite_reason(bad_items: Sequence[int]) -> str:
    which = ", ".join(map(str, bad_items[:8])) + (" ..." if len(bad_items) > 8 else "")
    noun = "item" if len(bad_items) == 1 else "items"
    return f"nonfinite: NaN/Inf in the features of {noun} {which}"


def describe_sample(
    rep: SampleReport, items: Sequence[MediaItem], nonfinite: Sequence[int] = ()
) -> str:
    """A full sentence naming the sample, its id, the item and both counts (for a sample
    whose features hold NaN/Inf, ``nonfinite`` lists those items and names the cause)."""
    if nonfinite and rep.ok:
        idx = nonfinite[0]
        it = items[idx]
        sid = rep.sample_id
        head = f"sample {rep.sample}" + (f" (sample_id {sid!r})" if sid is not None else "")
        return (
            f"{head} row {rep.row}: {nonfinite_reason(nonfinite)} "
            f"(item {idx}: {_media(it)}); its placeholder runs {list(rep.expected)} match "
            f"the item features {list(rep.got)}."
        )
    idx, item = _item_of(rep, items)
    head = [f"sample {rep.sample}"]
    sid = rep.sample_id
    if sid is not None:
        head.append(f"(sample_id {sid!r})")
    head.append(f"row {rep.row}: {rep.status} — {rep.reason}.")
    tail = [
        f"Placeholder runs {list(rep.expected)} ({sum(rep.expected)} in all) vs item features "
        f"{list(rep.got)} ({sum(rep.got)} in all)"
    ]
    if rep.first_mismatch is not None:
        tail.append(f"; first mismatching run {rep.first_mismatch}")
    if item is not None:
        tail.append(f", item {idx} ({_media(item)})")
    return " ".join(head) + " " + "".join(tail) + "."


def _media(item: MediaItem) -> str:
    media = item.modality
    if item.num_frames is not None:
        media += f", {item.num_frames} frames"
    if item.frame_hw is not None:
        media += f", frame {item.frame_hw[0]}x{item.frame_hw[1]} (HxW)"
    return f"{media}, {item.num_features} features"


def error_message(
    report: AlignmentReport,
    fatal: Sequence[int],
    items: Sequence[MediaItem],
    *,
    where: str,
    log_path: str | None,
    notes: dict[int, str] | None = None,
    nonfinite: dict[int, Sequence[int]] | None = None,
) -> str:
    """The raise message: where (rank/step), the first fatal sample in full, the others briefly.

    nonfinite: sample -> its items whose features hold NaN/Inf (the cause of those samples).
    Never raises: should building the text fail on some field, a shorter message that still
    names the samples and the failure takes its place (the alignment error must come out).
    """
    try:
        return _error_message(report, fatal, items, where, log_path, notes or {}, nonfinite or {})
    except Exception as err:
        return (
            f"Media alignment failed ({where}): samples {list(fatal)[:16]} "
            f"(the full message could not be built: {type(err).__name__})"
            + (f"\n  per-rank log: {log_path}" if log_path else "")
        )


def _error_message(report, fatal, items, where, log_path, notes, nonfinite) -> str:
    bad = [report.samples[s] for s in fatal]
    head = f"Media alignment failed ({where}): {len(bad)} of {len(report.samples)} samples"
    lines = [head + (":" if bad else ".")]

    def note(rep: SampleReport) -> str:
        return f" ({notes[rep.sample]})" if rep.sample in notes else ""

    if bad:
        first = bad[0]
        if first.ok and not nonfinite.get(first.sample) and first.sample in notes:
            # aligned tokens raised for another reason (a generated placeholder, a shared row)
            sid = first.sample_id
            head = f"sample {first.sample}" + (f" (sample_id {sid!r})" if sid is not None else "")
            lines.append(f"  {head} row {first.row}: {notes[first.sample]}")
        else:
            lines.append("  " + describe_sample(first, items, nonfinite.get(first.sample, ())))
            lines[-1] += note(first)
    for rep in bad[1:6]:
        if rep.ok and nonfinite.get(rep.sample):
            why = nonfinite_reason(nonfinite[rep.sample]) + note(rep)
        elif rep.ok and rep.sample in notes:
            why = notes[rep.sample]
        else:
            why = f"{rep.status} — {rep.reason}{note(rep)}"
        lines.append(f"  sample {rep.sample}: {why}")
    if len(bad) > 6:
        lines.append(f"  ... and {len(bad) - 6} more")
    if report.orphans:
        lines.append(f"  items with no placeholder run: {list(report.orphans)[:10]}")
    lines.append(
        f"  batch: {report.num_runs} runs / {report.num_items} items, "
        f"{report.total_placeholders} placeholders / {report.total_features} features"
    )
    if log_path:
        lines.append(f"  per-rank log: {log_path}")
    return "\n".join(lines)


def plan_records(
    report: AlignmentReport,
    plan: Plan,
    items: Sequence[MediaItem],
    step: int | None,
    microbatch: int | None,
    aligned: Callable[[int, str], GuardRecord],
) -> list[tuple[int, str, GuardRecord]]:
    """``(sample, action, record)`` for every dropped or raised sample, in sample order: a mismatched
    sample described by its runs (the plan's override reason, e.g. a suspected swap, first),
    any other by ``aligned(sample, action)`` (NaN/Inf features, a shared grid row)."""
    bad = {rep.sample: rep for rep in report.mismatched}
    reasons = dict(plan.reasons)
    out = []
    for smp, act in enumerate(plan.actions):
        if act not in ("drop", "raise"):
            continue
        if smp in bad:
            rec = sample_record(bad[smp], items, act, act, step=step, microbatch=microbatch)
            if reasons.get(smp):
                rec = replace(rec, reason=f"{reasons[smp]}; {rec.reason}")
        else:
            rec = aligned(smp, act)
        out.append((smp, act, rec))
    return out


def check_records(
    report: AlignmentReport, step: int | None, microbatch: int | None, orphans: str
) -> list[GuardRecord]:
    """``check`` records of what no sample's decision covers: items tied to no placeholder run
    (``orphans``, formatted with their indices) and placeholders in a packed row's padding."""
    out = []
    if report.orphans:
        why = orphans.format(list(report.orphans)[:16])
        out.append(
            GuardRecord(
                event="check", step=step, microbatch=microbatch, action="unused", reason=why
            )
        )
    if report.stray_findings:
        why = "; ".join(f.describe() for f in report.stray_findings[:4])
        out.append(
            GuardRecord(
                event="check", step=step, microbatch=microbatch, action="ignored", reason=why
            )
        )
    return out
