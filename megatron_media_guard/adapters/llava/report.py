"""Records, the raise message and the stage outcome of one guarded LLaVA call."""

from __future__ import annotations

from collections.abc import Sequence

from ...core.conclude import settle_plan
from ...core.items import MediaItem
from ...core.plan import Plan, digest
from ...diagnostics import GuardRecord
from .checks import LlavaFault
from .measure import LlavaFacts

CALLER = "megatron_media_guard.adapters.llava"


def sample_id(items: Sequence[MediaItem] | None, smp: int):
    if not items:
        return None
    return next(
        (it.sample_id for it in items if it.sample == smp and it.sample_id is not None), None
    )


def emit(guard, faults, actions, batch_fatal, notes, why_raise, items, facts, step, mb) -> None:
    for f in faults:
        act = actions[f.sample]
        reason = f"{f.check}: {f.reason}"
        if f.sample in why_raise:
            reason += f" (raise: {why_raise[f.sample]})"
        guard.log.emit(
            GuardRecord(
                event="raise" if act == "raise" else "drop",
                step=step,
                microbatch=mb,
                sample=f.sample,
                sample_id=sample_id(items, f.sample),
                row=facts.spans[f.sample].row,
                item=f.item,
                modality=f.modality,
                expected=f.expected,
                got=f.got,
                first_mismatch=0 if f.check == "count" else None,
                tiles=f.tiles,
                action=act,
                reason=reason,
                extra={"adapter": "llava", "check": f.check},
            ),
            caller=CALLER,
        )
    for text, fatal in [(t, True) for t in batch_fatal] + [(t, False) for t in notes]:
        guard.log.emit(
            GuardRecord(
                event="raise" if fatal else "check",
                step=step,
                microbatch=mb,
                action="raise" if fatal else "unused",
                reason=text,
                extra={"adapter": "llava", "check": text.split(":")[0]},
            ),
            caller=CALLER,
        )


def _fault_line(f: LlavaFault, items, why_raise) -> str:
    sid = sample_id(items, f.sample)
    head = f"  sample {f.sample}" + (f" (sample_id {sid!r})" if sid is not None else "")
    if f.item is not None:
        what = "image" if f.modality == "image" else "clip"
        head += f", {what} {f.item} (#{f.item_in_sample} in the sample"
        head += f", {f.tiles} tiles)" if f.tiles is not None else ")"
    tail = f" (raise: {why_raise[f.sample]})" if f.sample in why_raise else ""
    label = f.check if f.modality != "sound" else f"sound {f.check}"
    return f"{head}: {label} - {f.reason}; expected {list(f.expected)}, got {list(f.got)}{tail}"


def settle(
    guard,
    facts: LlavaFacts,
    owners,
    faults: Sequence[LlavaFault],
    actions: Sequence[str],
    batch_fatal: Sequence[str],
    why_raise: dict[int, str],
    items,
    step,
    mb,
):
    """The raise message (when a sample or the batch must raise) and the plan of this call,
    agreed with the stage and counted through the core's :func:`settle_plan`."""
    where = guard.where(step, mb)
    fatal = [i for i, x in enumerate(actions) if x == "raise"]
    message = None
    unit = "packed sub-samples" if facts.packed else "samples"
    if fatal or batch_fatal:
        lines = [
            f"Media alignment failed ({where}): LLaVA _preprocess_data, "
            f"{len(fatal)} of {facts.batch} {unit}"
            + (f" and {len(batch_fatal)} batch-level problem(s)" if batch_fatal else "")
            + ":"
        ]
        lines += [f"  batch {t}" for t in batch_fatal]
        lines += [_fault_line(f, items, why_raise) for f in faults if actions[f.sample] == "raise"][
            :8
        ]
        lines.append(
            f"  batch: {facts.total_tokens} image tokens / {facts.num_entries} num_image_tiles "
            f"entries ({sum(facts.entries)} tiles), img_seq_len {facts.img_seq_len}, "
            f"language_max_sequence_length {facts.max_len}"
            + (
                f"; {sum(facts.sound)} sound tokens / {sum(facts.clip_rows)} rows in "
                f"{facts.num_clips} clips"
                if facts.clip_rows or any(facts.sound)
                else ""
            )
        )
        if guard.log.path is not None:
            lines.append(f"  per-rank log: {guard.log.describe_path()}")
        message = "\n".join(lines)
    plan_digest = digest(
        facts.tokens,
        facts.entries,
        owners,
        actions,
        facts.img_seq_len,
        facts.max_len,
        [(f.check, f.modality, f.sample, f.item) for f in faults],
        batch_fatal,
    )
    plan = Plan(tuple(actions), (), plan_digest)
    mismatched = len({f.sample for f in faults})
    return settle_plan(guard, plan, step, mb, mismatched=mismatched, message=message)
