"""The one end of every fault path, whoever planned it (``MediaGuard.merge``'s parse, an
adapter's own checks: LLaVA's collapsed tokens): the records written (before the replay
bundle: a full disk must not cost them), the bundle, the raise message built from those
records (:func:`~.explain.alignment_message`), the stage's consensus round and the
counters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..diagnostics import DiagnosticsLog, GuardRecord
from .explain import alignment_message
from .outcome import LocalOutcome, StageOutcome
from .plan import Plan


class Concluding(Protocol):
    """What the end of a fault path reads and calls of the guard that passes itself in
    (:class:`~.guard.MediaGuard`, which imports this module: the guard is described here, not
    imported). ``counters`` are the guard's, counted here."""

    log: DiagnosticsLog
    counters: dict[str, int]

    def where(self, step: int | None, microbatch: int | None) -> str: ...
    def settle(self, local: LocalOutcome) -> StageOutcome: ...


def conclude(
    guard: Concluding,
    plan: Plan,
    records: Sequence[GuardRecord],
    *,
    step: int | None,
    microbatch: int | None,
    mismatched: int,
    summary: str,
    what: str | None = None,
    unit: str = "samples",
    fatal: bool = False,
    caller: str | None = None,
    bundle: Callable[[], object | None] | None = None,
    digest: int | None = None,
    samples: int | None = None,
) -> StageOutcome:
    """Writes ``records`` (one per dropped / raised sample, the call's checks), saves the
    replay bundle (``bundle()`` returns its path, or None), agrees the planned call with the
    stage and counts it; raises on every rank of the stage when any rank must, naming the
    culprit rank, step and sample (the first ``raise`` record is the one the peers fetch).

    The call is fatal when the plan raises a sample, a record raises (a batch-level problem)
    or ``fatal`` (e.g. items no run claims under ``policy="raise"``). ``summary`` / ``what`` /
    ``unit``: the message's batch totals, what was guarded, and what its samples are;
    ``digest``: the caller's plan digest (default: the plan's own). ``samples``: the call's
    samples, counted here as one merge where no merge counted the call (an adapter's own
    checks)."""
    written = [guard.log.emit(rec, caller=caller) for rec in records]
    first = next((w for w in written if w.get("event") == "raise"), None)
    path = bundle() if bundle is not None else None
    message = None
    if plan.fatal or first is not None or fatal:
        # a call fatal for no sample's sake (items no run claims): its check records say why
        shown = (
            written
            if first is not None
            else [{**w, "event": "raise"} if w.get("event") == "check" else w for w in written]
        )
        message = alignment_message(
            guard.where(step, microbatch),
            shown,
            total=len(plan.actions),
            summary=summary,
            what=what,
            unit=unit,
            log_path=guard.log.describe_path(),
            bundle=path,
        )
    local = LocalOutcome.of_plan(
        plan, step, microbatch, mismatched=mismatched, message=message, record=first, digest=digest
    )
    stage = guard.settle(local)
    if samples is not None:
        guard.counters["merges"] += 1
        guard.counters["samples"] += samples
    guard.counters["mismatched"] += mismatched
    guard.counters["dropped"] += len(plan.dropped)
    guard.counters["repaired"] += len(plan.repairs)
    return stage
