"""The end of every fault path, whoever planned it (``MediaGuard.merge``'s parse, the Qwen-VL
pre-hook's grid rows, the family engine through ``merge``): the message of a fatal plan, the
stage's consensus round, the counters. Records and the replay bundle are written before it
(a full disk must not cost the record), by the caller that knows what its items are."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..diagnostics import GuardRecord
from .alignment import AlignmentReport
from .explain import error_message
from .faults import FaultContext, ItemFault, batch_records, fault_message, fault_records
from .items import MediaItem
from .outcome import LocalOutcome, StageOutcome
from .plan import Plan

if TYPE_CHECKING:
    from .guard import MediaGuard


def conclude(
    guard: MediaGuard,
    report: AlignmentReport,
    plan: Plan,
    items: Sequence[MediaItem],
    *,
    step: int | None,
    microbatch: int | None,
    notes: Mapping[int, str] | None = None,
    fatal_record: dict | None = None,
    bundle: object | None = None,
    nonfinite: Mapping[int, list[int]] | None = None,
    digest: int | None = None,
) -> StageOutcome:
    """Agrees a planned fault with the stage and counts it; raises on every rank of the stage
    when any rank must (naming the culprit rank, step and sample).

    notes: per sample, what the caller adds to the message (grid rows, a failed repair);
    fatal_record: the first ``raise`` record this rank wrote (fetched by the peers);
    bundle: the replay bundle's path, if one was saved; digest: the caller's plan digest
    (default: the plan's own)."""
    message = None
    if plan.fatal or (report.orphans and guard.config.policy == "raise"):
        message = error_message(
            report,
            plan.fatal,
            items,
            where=guard.where(step, microbatch),
            log_path=guard.log.describe_path(),
            notes=dict(notes or {}),
            nonfinite=dict(nonfinite or {}),
        )
        if bundle is not None:
            message += f"\n  replay bundle: {bundle}"
    return settle_plan(
        guard,
        plan,
        step,
        microbatch,
        mismatched=len(report.mismatched),
        message=message,
        record=fatal_record,
        digest=digest,
    )


def conclude_faults(
    guard: MediaGuard,
    faults: Sequence[ItemFault],
    actions: Sequence[str],
    ctx: FaultContext,
    *,
    what: str,
    unit: str,
    summary: str,
    digest: int,
    step: int | None,
    microbatch: int | None,
    batch_fatal: Sequence[str] = (),
    notes: Sequence[str] = (),
    records: Sequence[GuardRecord] = (),
    caller: str | None = None,
    bundle: Callable[[], object | None] | None = None,
) -> StageOutcome:
    """The fault path of a call whose findings are :class:`~.faults.ItemFault` s (an
    adapter's own checks: LLaVA's collapsed tokens): one record per fault, the call's
    batch-level problems (``batch_fatal`` raise) and ``notes`` as records, then ``records``
    (e.g. generated placeholders fed as text), the raise message, the consensus round (the
    first ``raise`` record is the one the peers fetch) and the counters.

    actions: per sample (or packed sub-sample), keep / drop / raise; what / unit / summary:
    the message's words for what was guarded, its samples, and the batch's totals; bundle:
    saves the call's replay bundle (after the records: a full disk must not cost them) and
    returns its path, named in the message."""
    fatal_record = None
    recs = [
        *fault_records(faults, actions, ctx, step=step, microbatch=microbatch),
        *batch_records(batch_fatal, notes, ctx.adapter, step, microbatch),
        *records,
    ]
    for rec in recs:
        written = guard.log.emit(rec, caller=caller)
        if rec.event == "raise" and fatal_record is None:
            fatal_record = written
    message = fault_message(
        faults,
        actions,
        ctx,
        where=guard.where(step, microbatch),
        what=what,
        unit=unit,
        batch_fatal=batch_fatal,
        summary=summary,
        log_path=guard.log.describe_path(),
    )
    path = bundle() if bundle is not None else None
    if message is not None and path is not None:
        message += f"\n  replay bundle: {path}"
    plan = Plan(tuple(actions), (), digest)
    return settle_plan(
        guard,
        plan,
        step,
        microbatch,
        mismatched=len({f.sample for f in faults}),
        message=message,
        record=fatal_record,
    )


def settle_plan(
    guard: MediaGuard,
    plan: Plan,
    step: int | None,
    microbatch: int | None,
    *,
    mismatched: int,
    message: str | None = None,
    record: dict | None = None,
    digest: int | None = None,
) -> StageOutcome:
    """This rank's outcome of a planned call (fatal when there is a ``message``) agreed with
    the stage, and the guard's counters: the last step of every guarded call that found
    something, :func:`conclude`'s and the adapters' whose findings are their own (LLaVA's
    per-tile checks)."""
    local = LocalOutcome.of_plan(
        plan, step, microbatch, mismatched=mismatched, message=message, record=record, digest=digest
    )
    stage = guard.settle(local)
    guard.counters["mismatched"] += mismatched
    guard.counters["dropped"] += len(plan.dropped)
    guard.counters["repaired"] += len(plan.repairs)
    return stage
