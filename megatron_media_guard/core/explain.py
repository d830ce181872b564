"""Turning alignment facts into diagnostic records and error messages (no tensors here)."""

from __future__ import annotations

from collections.abc import Sequence

from ..diagnostics import GuardRecord
from .alignment import AlignmentReport, SampleReport
from .items import MediaItem


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
        action=action,
        reason=f"{rep.status}: {rep.reason}",
        extra={"status": str(rep.status), "findings": [f.describe() for f in rep.findings[:8]]},
    )


def describe_sample(rep: SampleReport, items: Sequence[MediaItem]) -> str:
    """A full sentence naming the sample, its id, the item and both counts."""
    idx, item = _item_of(rep, items)
    parts = [f"sample {rep.sample}"]
    if rep.sample_id is not None:
        parts.append(f"(sample_id {rep.sample_id!r})")
    parts.append(f"row {rep.row}: {rep.status} — {rep.reason}.")
    parts.append(
        f"Placeholder runs {list(rep.expected)} ({sum(rep.expected)} in all) vs item features "
        f"{list(rep.got)} ({sum(rep.got)} in all)"
    )
    if rep.first_mismatch is not None:
        parts.append(f"; first mismatching run {rep.first_mismatch}")
    if item is not None:
        media = f"item {idx} ({item.modality}"
        if item.num_frames is not None:
            media += f", {item.num_frames} frames"
        if item.frame_hw is not None:
            media += f", frame {item.frame_hw[0]}x{item.frame_hw[1]} (HxW)"
        parts.append(f", {media}, {item.num_features} features)")
    return " ".join(parts[:3]) + " " + "".join(parts[3:]) + "."


def error_message(
    report: AlignmentReport,
    fatal: Sequence[int],
    items: Sequence[MediaItem],
    *,
    where: str,
    log_path: str | None,
    notes: dict[int, str] | None = None,
) -> str:
    """The raise message: where (rank/step), the first fatal sample in full, the others briefly."""
    bad = [report.samples[s] for s in fatal]
    head = f"Media alignment failed ({where}): {len(bad)} of {len(report.samples)} samples"
    lines = [head + (":" if bad else ".")]
    notes = notes or {}

    def note(rep: SampleReport) -> str:
        return f" ({notes[rep.sample]})" if rep.sample in notes else ""

    if bad:
        lines.append("  " + describe_sample(bad[0], items) + note(bad[0]))
    for rep in bad[1:6]:
        lines.append(f"  sample {rep.sample}: {rep.status} — {rep.reason}{note(rep)}")
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
