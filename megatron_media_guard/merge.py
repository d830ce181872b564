"""The guarded merge: the drop-in for ``emb.masked_scatter(mask, feats)``.

Aligned path: build the token masks, verify every run against its item on the
device, pull one five-integer verdict to the host, scatter. Everything else
(full parse, per-sample report, plan, repair, diagnostics) happens only when the
verdict says something is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import repair as repair_mod
from .alignment import AlignmentReport, align
from .config import GuardConfig
from .diagnostics import DiagnosticsLog, GuardRecord, RankInfo
from .errors import MediaAlignmentError, MediaInputError
from .explain import error_message, sample_record
from .grammar import Grammar
from .host import to_host
from .items import Batch, MediaItem, normalize
from .outcome import Consensus, LocalOutcome, StageOutcome
from .plan import Plan, build_plan
from .runs import TokenLayout, parse_layout
from .validate import check_inputs
from .verify import Verdict, verify


@dataclass(frozen=True)
class GuardReport:
    """What one guarded merge found and did.

    ok: every sample was aligned (nothing dropped, repaired or raised).
    actions: per sample, ``keep`` / ``drop`` / ``repair``.
    alignment: the per-sample report; None on the aligned path (nothing to diagnose).
    """

    ok: bool
    step: int | None
    microbatch: int | None
    rank: int | None
    num_samples: int
    num_items: int
    actions: tuple[str, ...]
    dropped: tuple[int, ...]
    repaired: tuple[int, ...]
    alignment: AlignmentReport | None
    verdict: Verdict
    digest: int
    stage: StageOutcome | None = None


@dataclass(frozen=True)
class MergeResult:
    """embeddings: like the input (``[b, s, h]`` or ``[s, b, h]``). loss_mask / labels: the
    caller's, with dropped samples zeroed / ignored (a loss mask is created when a sample is
    dropped and none was given)."""

    embeddings: torch.Tensor
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None
    report: GuardReport


class MediaGuard:
    """Guards the merge of media features into text embeddings, per sample and per rank.

    config: policies and log directory. grammar: the model family's placeholder tokens.
    rank: this rank's coordinates for diagnostics (default: from the RANK variable).
    consensus: agrees decisions across ranks (see ``consensus.py``); None: single process.
    geometry / encoder: used by ``policy="repair"`` to re-project mismatched items.
    """

    def __init__(
        self,
        config: GuardConfig | None = None,
        grammar: Grammar | None = None,
        *,
        rank: RankInfo | None = None,
        consensus: Consensus | None = None,
        geometry: object | None = None,
        encoder: object | None = None,
    ) -> None:
        if grammar is None:
            raise MediaInputError("MediaGuard needs a grammar (e.g. Grammar.qwen2_vl())")
        self.config = config or GuardConfig()
        self.grammar = grammar
        self.rank = rank or RankInfo.from_env()
        self.consensus = consensus
        self.geometry = geometry
        self.encoder = encoder
        self.log = DiagnosticsLog(self.config.log_dir, self.rank)
        self.counters = {"merges": 0, "samples": 0, "mismatched": 0, "dropped": 0, "repaired": 0}

    # ---- public ---------------------------------------------------------------

    def check(
        self,
        input_ids: torch.Tensor,
        items: Sequence[MediaItem],
        cu_seqlens: torch.Tensor | None = None,
    ) -> AlignmentReport:
        """The full per-sample report, without merging."""
        lay = TokenLayout(input_ids, self.grammar, cu_seqlens)
        normalize_items = normalize(
            [torch.empty(it.num_features, 0) for it in items], items, lay.num_samples
        )
        return align(parse_layout(lay), normalize_items.items, explicit=normalize_items.explicit)

    def merge(
        self,
        embeddings: torch.Tensor,
        input_ids: torch.Tensor,
        features: torch.Tensor | Sequence[torch.Tensor],
        items: Sequence[MediaItem] | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        seq_first: bool = False,
        step: int | None = None,
        microbatch: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
        encoder: object | None = None,
    ) -> MergeResult:
        """Scatter ``features`` into ``embeddings`` at the placeholder positions of ``input_ids``.

        embeddings: ``[b, s, h]`` (``[s, b, h]`` with ``seq_first``); input_ids: ``[b, s]``
        (``[1, T]`` with ``cu_seqlens`` ``[n+1]`` for packed samples); features: ``[sum(n_i), h]``
        or a list of ``[n_i, h]``, in the order of ``items``; loss_mask / labels: ``[b, s]``.
        """
        where = self._where(step, microbatch)
        try:
            return self._merge(
                embeddings,
                input_ids,
                features,
                items,
                loss_mask,
                labels,
                seq_first,
                step,
                microbatch,
                cu_seqlens,
                encoder,
            )
        except MediaAlignmentError as err:
            if err.context.get("where"):
                raise
            raise err.with_context(f"MediaGuard.merge ({where}): ", where=where) from None

    def on_step_end(self, step: int) -> dict[str, int]:
        """Counters since the last call (merges, samples, mismatched, dropped, repaired),
        written as a ``step`` record; reset afterwards. The drop budget hooks in here."""
        counts = dict(self.counters)
        hook = getattr(self.consensus, "on_step_end", None)
        if hook is not None:
            hook(step, counts, self)
        self.log.emit(GuardRecord(event="step", step=step, extra=counts))
        for k in self.counters:
            self.counters[k] = 0
        return counts

    # ---- internals --------------------------------------------------------------

    def _where(self, step: int | None, microbatch: int | None) -> str:
        r = self.rank.rank
        parts = [f"rank {r}" if r is not None else "single process (RANK unset)"]
        if step is not None:
            parts.append(f"step {step}")
        if microbatch is not None:
            parts.append(f"microbatch {microbatch}")
        return ", ".join(parts)

    def _merge(
        self,
        embeddings,
        input_ids,
        features,
        items,
        loss_mask,
        labels,
        seq_first,
        step,
        microbatch,
        cu_seqlens,
        encoder,
    ) -> MergeResult:
        if self.grammar.collapsed:
            raise MediaInputError(
                f"grammar {self.grammar.name!r} is collapsed (one token per item, expanded by the "
                "model): use the LLaVA adapter, not the generic merge"
            )
        lay = TokenLayout(input_ids, self.grammar, cu_seqlens)
        batch = normalize(features, items, lay.num_samples)
        emb = check_inputs(embeddings, input_ids, batch.features, loss_mask, labels, seq_first, lay)
        order = batch.order
        lengths = [batch.items[i].num_features for i in order]
        mods = [self.grammar.modality_code(batch.items[i].modality) for i in order]
        samples = [batch.items[i].sample for i in order] if batch.explicit else None
        check_finite = self.config.nonfinite != "off"
        verdict = verify(
            lay,
            input_ids.reshape(-1),
            lengths,
            mods,
            samples,
            batch.features if check_finite else None,
        )
        self.counters["merges"] += 1
        self.counters["samples"] += lay.num_samples
        if verdict.aligned(len(batch.items)):
            plan = build_plan(lay.num_samples, batch.items, verdict, None, self.config)
            stage = self._agree(plan, None, step, microbatch, None, None)
            src = batch.features
            if order != tuple(range(len(order))):
                src = batch.features.index_select(0, _rows_index(batch, order, src.device))
            out = emb.masked_scatter(lay.ph.view(emb.shape[:2]).unsqueeze(-1), src)
            return self._result(
                out, seq_first, loss_mask, labels, plan, None, verdict, step, microbatch, stage, lay
            )
        return self._diagnose(
            input_ids,
            cu_seqlens,
            lay,
            batch,
            emb,
            verdict,
            loss_mask,
            labels,
            seq_first,
            step,
            microbatch,
            encoder or self.encoder,
        )

    def _diagnose(
        self,
        input_ids,
        cu_seqlens,
        lay,
        batch: Batch,
        emb,
        verdict,
        loss_mask,
        labels,
        seq_first,
        step,
        microbatch,
        encoder,
    ) -> MergeResult:
        report = align(parse_layout(lay), batch.items, explicit=batch.explicit)
        nonfinite = _nonfinite_samples(batch, report) if verdict.nonfinite else frozenset()
        plan = build_plan(lay.num_samples, batch.items, verdict, report, self.config, nonfinite)
        replaced: dict[int, torch.Tensor] = {}
        if plan.repairs:
            plan, replaced = repair_mod.run_repairs(
                plan, batch, self, encoder, step=step, microbatch=microbatch
            )
        bundle_path = self._dump(input_ids, cu_seqlens, batch, report, step, microbatch)
        fatal_msg = None
        fatal_record = None
        for rep in report.mismatched:
            act = plan.actions[rep.sample]
            if act in ("drop", "raise"):
                rec = self.log.emit(
                    sample_record(rep, batch.items, act, act, step=step, microbatch=microbatch)
                )
                if act == "raise" and fatal_record is None:
                    fatal_record = rec
        for smp in sorted(set(range(lay.num_samples)) - {r.sample for r in report.mismatched}):
            if plan.actions[smp] != "keep":  # nonfinite features in an otherwise aligned sample
                self.log.emit(
                    GuardRecord(
                        event=plan.actions[smp],
                        step=step,
                        microbatch=microbatch,
                        sample=smp,
                        action=plan.actions[smp],
                        reason="nonfinite: NaN/Inf in the sample's features",
                    )
                )
        if report.orphans:
            self.log.emit(
                GuardRecord(
                    event="check",
                    step=step,
                    microbatch=microbatch,
                    action="unused",
                    reason=f"items {list(report.orphans)[:16]} have no placeholder run",
                )
            )
        if plan.fatal or (report.orphans and self.config.policy == "raise"):
            fatal_msg = error_message(
                report,
                plan.fatal,
                batch.items,
                where=self._where(step, microbatch),
                log_path=str(self.log.path) if self.log.path else None,
            )
            if bundle_path is not None:
                fatal_msg += f"\n  replay bundle: {bundle_path}"
        stage = self._agree(plan, report, step, microbatch, fatal_msg, fatal_record)
        keep = torch.tensor([a in ("keep", "repair") for a in plan.actions], device=emb.device)
        self.counters["mismatched"] += len(report.mismatched)
        self.counters["dropped"] += len(plan.dropped)
        self.counters["repaired"] += len(replaced)
        out = _merge_kept(emb, lay, batch, report, plan, replaced, keep)
        return self._result(
            out,
            seq_first,
            loss_mask,
            labels,
            plan,
            report,
            verdict,
            step,
            microbatch,
            stage,
            lay,
            keep,
        )

    def _dump(self, input_ids, cu_seqlens, batch: Batch, report, step, microbatch):
        """Saves a replay bundle of a mismatched micro-batch when ``config.dump_dir`` is set."""
        cfg = self.config
        if cfg.dump_dir is None or report.ok:
            return None
        from .bundle import save_bundle

        return save_bundle(
            cfg.dump_dir,
            input_ids=input_ids,
            items=batch.items,
            grammar=self.grammar,
            cu_seqlens=cu_seqlens,
            config=cfg,
            rank=self.rank,
            step=step,
            microbatch=microbatch,
            report=report,
            include_pixels=cfg.dump_pixels,
            features=batch.features if cfg.dump_features else None,
            max_bundles=cfg.dump_max,
        )

    def _agree(self, plan: Plan, report, step, microbatch, fatal_msg, fatal_record) -> StageOutcome:
        """Hands this rank's outcome to the consensus (or takes it as the stage's) and raises
        on every rank when any rank of the stage must."""
        mismatched = len(report.mismatched) if report is not None else 0
        fatal_sample = plan.fatal[0] if plan.fatal else None
        local = LocalOutcome(
            step=step,
            microbatch=microbatch,
            digest=plan.digest,
            num_samples=len(plan.actions),
            mismatched=mismatched,
            dropped=len(plan.dropped),
            repaired=len(plan.repairs),
            fatal=fatal_msg is not None,
            fatal_sample=fatal_sample,
            message=fatal_msg,
            record=fatal_record,
        )
        stage = (
            self.consensus.agree(local)
            if self.consensus is not None
            else StageOutcome.local(local, self.rank.rank)
        )
        if stage.fatal:
            if fatal_msg is not None and stage.culprit_rank in (None, self.rank.rank):
                raise MediaAlignmentError(
                    fatal_msg,
                    context={"where": self._where(step, microbatch), "sample": fatal_sample},
                )
            raise MediaAlignmentError(
                f"Media alignment failed on rank {stage.culprit_rank} (step {stage.culprit_step}, "
                f"sample {stage.culprit_sample}); this rank stops with it.\n{stage.message or ''}",
                context={
                    "where": self._where(step, microbatch),
                    "culprit_rank": stage.culprit_rank,
                },
            )
        return stage

    def _result(
        self,
        out,
        seq_first,
        loss_mask,
        labels,
        plan,
        report,
        verdict,
        step,
        microbatch,
        stage,
        lay,
        keep=None,
    ) -> MergeResult:
        if seq_first:
            out = out.transpose(0, 1).contiguous()
        dropped = plan.dropped
        if dropped:
            drop_tok = ~keep[lay.sample.clamp(max=lay.num_samples - 1)]
            drop_tok = (drop_tok & (lay.sample < lay.num_samples)).view(lay.batch, lay.row_length)
            base = (
                loss_mask
                if loss_mask is not None
                else torch.ones(lay.batch, lay.row_length, dtype=torch.float32, device=out.device)
            )
            loss_mask = base.masked_fill(drop_tok, 0)
            if labels is not None:
                labels = labels.masked_fill(drop_tok, self.config.ignore_index)
        report_obj = GuardReport(
            ok=plan.keeps_all and report is None,
            step=step,
            microbatch=microbatch,
            rank=self.rank.rank,
            num_samples=lay.num_samples,
            num_items=verdict.runs if report is None else report.num_items,
            actions=plan.actions,
            dropped=dropped,
            repaired=tuple(r.item for r in plan.repairs),
            alignment=report,
            verdict=verdict,
            digest=plan.digest,
            stage=stage,
        )
        return MergeResult(out, loss_mask, labels, report_obj)


def _rows_index(batch: Batch, item_order: Sequence[int], device: torch.device) -> torch.Tensor:
    """Feature rows of the given items, concatenated in that order. ``[sum n]`` int64."""
    parts = [torch.arange(*batch.rows(i)) for i in item_order]
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return idx.to(device, non_blocking=True)


def _nonfinite_samples(batch: Batch, report: AlignmentReport) -> frozenset[int]:
    """Samples owning an item with NaN/Inf features (one transfer of one flag per item)."""
    f = batch.features
    flags = (
        torch.stack(
            [~torch.isfinite(f[slice(*batch.rows(i))]).all() for i in range(len(batch.items))]
        )
        if batch.items
        else torch.zeros(0, dtype=torch.bool)
    )
    bad = to_host(flags, why="which items hold NaN/Inf").tolist()
    owner = {i: rep.sample for rep in report.samples for i in rep.items}
    return frozenset(owner[i] for i, b in enumerate(bad) if b and i in owner)


def _merge_kept(
    emb,
    lay: TokenLayout,
    batch: Batch,
    report: AlignmentReport,
    plan: Plan,
    replaced: dict[int, torch.Tensor],
    keep: torch.Tensor,
) -> torch.Tensor:
    """Scatter only kept (and repaired) samples' items; anchor the rest with a zero term.

    Kept samples are aligned, so their items, in sample order, fill their runs exactly.
    """
    kept_items = [
        i
        for rep in report.samples
        if plan.actions[rep.sample] in ("keep", "repair")
        for i in rep.items
    ]
    f = batch.features
    pieces = [replaced[i] if i in replaced else f[slice(*batch.rows(i))] for i in kept_items]
    src = torch.cat(pieces) if pieces else f[:0]
    ph_keep = (
        lay.ph & keep[lay.sample.clamp(max=lay.num_samples - 1)] & (lay.sample < lay.num_samples)
    )
    out = emb.masked_scatter(ph_keep.view(emb.shape[:2]).unsqueeze(-1), src)
    unused = sorted(set(range(len(batch.items))) - set(kept_items) | set(replaced))
    if unused:
        # keep the vision tower in the autograd graph (DDP/FSDP hooks fire as usual):
        # add -0.0, the exact additive identity for every float including -0.0 itself.
        rows = f.index_select(0, _rows_index(batch, unused, f.device))
        clean = torch.where(torch.isfinite(rows), rows, torch.zeros_like(rows))
        anchor = -(clean * 0).abs().sum()
        out = out.clone() if out is emb else out
        out[0, 0, 0] = out[0, 0, 0] + anchor.to(out.dtype)
    return out
