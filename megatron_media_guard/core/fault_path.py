"""The fault path of :class:`~.guard.MediaGuard` (what runs only when the verdict says
something is off), and :func:`conclude`, the one end of every fault path, whoever planned it
(the guard's parse, an adapter's own checks: LLaVA's collapsed tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch

from ..config import GuardConfig
from ..diagnostics import DiagnosticsLog, GuardRecord, RankInfo, get_logger
from .alignment import align, by_key
from .apply import nonfinite_items, scatter_kept
from .explain import alignment_message, batch_summary, check_records, plan_records
from .generated import as_text, find_generated, text_records
from .grammar import Grammar
from .items import Batch
from .outcome import LocalOutcome, MergeResult, StageOutcome
from .plan import Plan, build_plan
from .providers import bundle_writer
from .repairs import RepairContext, run_repairs
from .runs import TokenLayout, parse_layout
from .verify import Verdict


@dataclass(frozen=True)
class Call:
    """One guarded call's validated inputs (``emb``: the ``[b, s, h]`` view)."""

    emb: torch.Tensor | None  # None: the last pipeline stage (no features, no merge)
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    lay: TokenLayout
    batch: Batch
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None
    seq_first: bool
    step: int | None
    microbatch: int | None
    encoder: object | None
    repairs: Literal["assume", "attempt"] = "assume"  # without features (emb None): last_stage
    sample_ids: tuple | None = None  # per sample, the caller's id (items without one take it)
    #: the caller's checks of the whole call, run by the fault path only (see MediaGuard.merge)
    fault_checks: Callable[[], Sequence[str]] | None = None


class Diagnosing(Protocol):
    """What the fault path reads of :class:`~.guard.MediaGuard` (which imports this module)."""

    log: DiagnosticsLog
    counters: dict[str, int]
    config: GuardConfig
    grammar: Grammar
    geometry: object | None

    @property
    def rank(self) -> RankInfo: ...
    def where(self, step: int | None, microbatch: int | None) -> str: ...
    def settle(self, local: LocalOutcome) -> StageOutcome: ...
    def result(self, c: Call, out, plan: Plan, report, verdict, stage, keep) -> MergeResult: ...


def diagnose(
    guard: Diagnosing, c: Call, verdict: Verdict, found: list[int] | None = None
) -> MergeResult:
    """Full parse, per-sample report, plan, repairs, records, bundle, the consensus round, then
    the merge of what is kept. ``found``: the items holding NaN/Inf, where already asked.
    Placeholders the policy generated (:mod:`.generated`) are text from here on."""
    gen = find_generated(c.lay, c.labels, c.loss_mask, guard.config.ignore_index)
    if gen is not None:
        ids, lay = as_text(
            c.input_ids, gen, guard.grammar.neutral_text_id(), c.cu_seqlens, guard.grammar
        )
        c = replace(c, input_ids=ids, lay=lay)
    batch = c.batch
    report = align(parse_layout(c.lay), batch.items)
    if c.sample_ids is not None:  # the caller's per-sample ids where no item names one
        ids = c.sample_ids
        named = [
            r
            if r.sample_id is not None or r.sample >= len(ids)
            else replace(r, sample_id=ids[r.sample])
            for r in report.samples
        ]
        report = replace(report, samples=tuple(named))
    nonfinite: dict[int, list[int]] = {}  # sample -> its items holding NaN/Inf
    if verdict.nonfinite:
        owner = {i: rep.sample for rep in report.samples for i in rep.items}
        bad = found if found is not None else nonfinite_items(batch)
        nonfinite = by_key((owner[i], i) for i in bad if i in owner)
    found_in_call = tuple(c.fault_checks()) if c.fault_checks is not None else ()
    plan = build_plan(
        c.lay.num_samples,
        batch.items,
        verdict,
        report,
        guard.config,
        frozenset(nonfinite),
        gen,
        found_in_call,
    )
    replaced: dict[int, torch.Tensor] = {}
    failures: dict[int, str] = {}
    if plan.repairs and c.emb is None and c.repairs == "assume":
        plan = plan.with_actions(plan.actions, plan.repairs)  # the first stage's, all repaired
    elif plan.repairs:
        # repairs re-encode with the caller's encoder and return their outcome; never the guard
        ctx = RepairContext(guard.geometry, guard.config, guard.grammar.name)
        out = run_repairs(plan, batch, ctx, c.encoder, step=c.step, microbatch=c.microbatch)
        plan, replaced, failures = out.plan, out.replaced, out.failures
        for rec in out.records:
            guard.log.emit(rec)
    # one record per dropped or fatal sample, one for unused items, one per sample whose
    # generated placeholders were fed as text
    failed = {k: f"repair failed, {v}" for k, v in failures.items()}
    records = plan_records(
        report, plan, batch.items, c.step, c.microbatch, nonfinite=nonfinite, gen=gen, failed=failed
    )
    records += check_records(report, c.step, c.microbatch)
    if gen is not None and guard.config.generated == "text":
        kept = {s for s, a in enumerate(plan.actions) if a in ("keep", "repair")}
        records += text_records(gen, c.step, c.microbatch, guard.grammar.neutral_text_id(), kept)
    stage = conclude(
        guard,
        plan,
        records,
        step=c.step,
        microbatch=c.microbatch,
        mismatched=len(report.mismatched),
        summary=batch_summary(report),
        fatal=bool(report.orphans) and guard.config.policy == "raise",
        caller=__name__,
        bundle=lambda: (
            None
            if report.ok
            else save_replay(  # after the records: a full disk
                guard,  # must not cost them
                input_ids=c.input_ids,
                items=batch.items,
                cu_seqlens=c.cu_seqlens,
                step=c.step,
                microbatch=c.microbatch,
                report=report,
                features=batch.features if guard.config.dump_features else None,
            )
        ),
    )
    keep = torch.tensor([a in ("keep", "repair") for a in plan.actions], device=c.input_ids.device)
    out = None
    if c.emb is not None:
        kept_items = [
            i for rep in report.samples if plan.actions[rep.sample] != "drop" for i in rep.items
        ]
        out = scatter_kept(c.emb, c.lay, batch, kept_items, replaced, keep)
    return guard.result(c, out, plan, report, verdict, stage, keep)


def conclude(
    guard: Diagnosing,
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
    samples: int | None = None,
) -> StageOutcome:
    """Writes ``records``, saves the replay bundle (``bundle()``: its path or None), agrees the
    planned call with the stage and counts it; raises on every rank when any rank must (the
    first ``raise`` record is what the peers fetch). Fatal when the plan or a record raises,
    or ``fatal`` (items no run claims under ``policy="raise"``). ``summary`` / ``what`` /
    ``unit``: the message's totals, what was guarded, what its samples are. ``samples``:
    counted here as one merge (an adapter's)."""
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
        plan, step, microbatch, mismatched=mismatched, message=message, record=first
    )
    stage = guard.settle(local)
    if samples is not None:
        guard.counters["merges"] += 1
        guard.counters["samples"] += samples
    guard.counters["mismatched"] += mismatched
    guard.counters["dropped"] += len(plan.dropped)
    guard.counters["repaired"] += len(plan.repairs)
    return stage


def save_replay(
    guard: Diagnosing, *, input_ids, items, cu_seqlens, step, microbatch, report, features=None
):
    """Saves a replay bundle when ``config.dump_dir`` is set; a failure is one error line."""
    cfg = guard.config
    if cfg.dump_dir is None:
        return None
    save_bundle = bundle_writer()  # replay/'s, through core/providers.py
    try:
        if save_bundle is None:
            raise RuntimeError("no bundle writer: import megatron_media_guard.replay.bundle_save")
        return save_bundle(
            cfg.dump_dir,
            input_ids=input_ids,
            items=items,
            grammar=guard.grammar,
            cu_seqlens=cu_seqlens,
            config=cfg,
            rank=guard.rank,
            step=step,
            microbatch=microbatch,
            report=report,
            include_pixels=cfg.dump_pixels,
            features=features,
            max_bundles=cfg.dump_max,
        )
    except Exception as err:  # a full disk under torch.save, an odd item field: never fatal
        get_logger().error(
            "[media-guard] replay bundle not saved in %s: %s: %s",
            cfg.dump_dir,
            type(err).__name__,
            err,
        )
        return None
