"""What a guarded LLaVA call says about its findings: the context of its item faults, the
summary line of its raise message and its plan digest. The records, the message, the
consensus round and the counters are core's (:func:`~megatron_media_guard.core.conclude.
conclude`), as for every fault path."""

from __future__ import annotations

from collections.abc import Sequence

from ...core.conclude import conclude
from ...core.fault_path import save_replay
from ...core.faults import FaultContext, ItemFault, batch_records, fault_records
from ...core.items import MediaItem
from ...core.plan import Plan, digest
from ...diagnostics import GuardRecord
from .measure import LlavaFacts

CALLER = "megatron_media_guard.adapters.llava"


def _summary(facts: LlavaFacts) -> str:
    out = (
        f"{facts.total_tokens} image tokens / {facts.num_entries} num_image_tiles "
        f"entries ({sum(facts.entries)} tiles), img_seq_len {facts.img_seq_len}, "
        f"language_max_sequence_length {facts.max_len}"
    )
    if facts.clip_rows or any(facts.sound):
        out += (
            f"; {sum(facts.sound)} sound tokens / {sum(facts.clip_rows)} rows in "
            f"{facts.num_clips} clips"
        )
    return out


def _bundle(guard, facts: LlavaFacts, faults, owners, items, ids, step, mb):
    """The replay bundle's saver, for the faults a replay can re-run: an image token too many
    or too few in a sample (a collapsed grammar's replay checks the runs per sample). The
    other checks (tiles, sequence length, NaN/Inf, sound, packed spans) read facts the bundle
    does not hold: no bundle."""
    if facts.packed or not any(f.check == "count" and f.modality == "image" for f in faults):
        return None
    if items is None:
        L = facts.img_seq_len
        items = [
            MediaItem(t * L, modality="image", sample=None if owners is None else owners[j])
            for j, t in enumerate(facts.entries)
        ]
    return lambda: save_replay(
        guard, input_ids=ids, items=items, cu_seqlens=None, step=step, microbatch=mb, report=None
    )


def settle(
    guard,
    facts: LlavaFacts,
    owners,
    faults: Sequence[ItemFault],
    actions: Sequence[str],
    *,
    batch_fatal: Sequence[str],
    notes: Sequence[str],
    why_raise: dict[int, str],
    items: Sequence[MediaItem] | None,
    records: Sequence[GuardRecord],
    ids,
    step,
    mb,
):
    """Records, raise message and plan of this call, agreed with the stage and counted by
    core's conclusion (:func:`~megatron_media_guard.core.conclude.conclude`)."""
    sids = {it.sample: it.sample_id for it in reversed(items or ()) if it.sample_id is not None}
    ctx = FaultContext("llava", lambda smp: facts.spans[smp].row, sids.get, why_raise)
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
    recs = [
        *fault_records(faults, actions, ctx, step=step, microbatch=mb),
        *batch_records(batch_fatal, notes, ctx.adapter, step, mb),
        *records,
    ]
    return conclude(
        guard,
        Plan(tuple(actions), (), plan_digest),
        recs,
        step=step,
        microbatch=mb,
        mismatched=len({f.sample for f in faults}),
        summary=_summary(facts),
        what="LLaVA _preprocess_data",
        unit="packed sub-samples" if facts.packed else "samples",
        caller=CALLER,
        bundle=_bundle(guard, facts, faults, owners, items, ids, step, mb),
        samples=facts.batch,
    )
