"""The guarded merge, the drop-in for ``emb.masked_scatter(mask, feats)``: every run verified
against its item on the device, one small verdict read, the scatter; the full parse, report,
plan and repair only when the verdict says something is off (``fault_path.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal

import torch

from ..config import GuardConfig
from ..diagnostics import DiagnosticsLog, GuardRecord, RankInfo, where_text
from ..errors import ConsensusError, MediaAlignmentError, MediaGuardError, MediaInputError
from .alignment import AlignmentReport, check_alignment
from .apply import mask_dropped, nonfinite_items, rows_index, scatter
from .fault_path import Call, diagnose
from .grammar import Grammar
from .interleave import RunOrder, in_token_order, verify_in_token_order
from .items import MediaItem, check_sample_id, metadata_batch, normalize
from .outcome import Consensus, GuardReport, LocalOutcome, MergeResult, StageOutcome
from .plan import Plan, build_plan
from .providers import default_consensus, process_rank
from .repairs import warn_unrepairable
from .runs import TokenLayout
from .validate import check_inputs, check_labels_dtype, check_masks
from .verify import Verdict, item_tables, verify


class MediaGuard:
    """Guards the merge of media features into text embeddings, per sample and per rank.

    config: policies and log directory. grammar: the model family's placeholder tokens.
    rank: this rank's coordinates for diagnostics (default: read at each record).
    consensus: agrees decisions across ranks (``ranks/consensus.py``). None: the default,
        resolved at the first guarded call that finds torch.distributed initialized;
        ``False``: each rank decides alone. Both defaults, and how a guard finds them
        (``core/providers.py``): docs/CONSENSUS.md.
    geometry / encoder: what ``policy="repair"`` re-projects with (without them it warns:
        every mismatch takes ``fallback``).
    """

    def __init__(
        self,
        config: GuardConfig | None = None,
        grammar: Grammar | None = None,
        *,
        rank: RankInfo | None = None,
        consensus: Consensus | bool | None = None,
        geometry: object | None = None,
        encoder: object | None = None,
    ) -> None:
        if grammar is None:
            raise MediaInputError("MediaGuard needs a grammar (e.g. Grammar.qwen2_vl())")
        if consensus is True:
            raise MediaInputError("consensus=True is not a consensus: pass one, None or False")
        self.config = config or GuardConfig()
        self.grammar = grammar
        self._codes = {m: k for k, m in enumerate(grammar.modalities)}
        # without one, ranks/ provides it (core/providers.py): the core never reads dist
        self._rank, self._rank_source = rank, process_rank if rank is None else None
        self._consensus = None if consensus is False else consensus
        self._consensus_pending = consensus is None  # resolved by the first guarded call
        self.geometry = geometry
        self.encoder = encoder
        self.log = DiagnosticsLog(self.config.log_dir, rank, rank_source=self._rank_source)
        self.counters = {"merges": 0, "samples": 0, "mismatched": 0, "dropped": 0, "repaired": 0}
        self.steps_ended = 0  # on_step_end calls so far (handles count micro-batches per step)
        self._agreed = True  # False between a merge's start and its collective
        self._bind(self._consensus)
        _ = self.consensus  # the default resolves now when torch.distributed is initialized
        # without an encoder a repair can still take one with each merge, or from the model
        if self.config.policy == "repair" and geometry is None:
            warn_unrepairable(encoder, self.config.fallback)

    @property
    def rank(self) -> RankInfo:
        return self._rank if self._rank_source is None else self._rank_source()

    @property
    def consensus(self) -> Consensus | None:
        """The consensus in use (the default: None until torch.distributed is initialized)."""
        if self._consensus_pending:
            cons = default_consensus()  # ranks/'s (core/providers.py); None before init
            if cons is not None:
                self._consensus, self._consensus_pending = cons, False
                self._bind(cons)
        return self._consensus

    def _bind(self, consensus: object | None) -> None:
        bind = getattr(consensus, "bind", None)
        if bind is not None:
            bind(self)

    # ---- public ---------------------------------------------------------------

    def check(
        self,
        input_ids: torch.Tensor,
        items: Sequence[MediaItem],
        cu_seqlens: torch.Tensor | None = None,
    ) -> AlignmentReport:
        """The full per-sample report, without merging (:func:`~.alignment.check_alignment`)."""
        return check_alignment(input_ids, items, self.grammar, cu_seqlens)

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
        order: RunOrder | None = None,
        fault_checks: Callable[[], Sequence[str]] | None = None,
    ) -> MergeResult:
        """Scatter ``features`` into ``embeddings`` at the placeholder positions of ``input_ids``.

        embeddings: ``[b, s, h]`` (``[s, b, h]`` with ``seq_first``); input_ids: ``[b, s]``
        (``[1, T]`` with ``cu_seqlens`` ``[n+1]`` for packed samples); features: ``[sum(n_i), h]``
        or a list of ``[n_i, h]``, in the order of ``items``; loss_mask / labels: ``[b, s]``.
        order: items in the model's consumption order, not token order
        (:class:`~.interleave.RunOrder`). fault_checks: the caller's checks of the whole call,
        run by the fault path only; each ``"<check>: ..."`` finding gives every sample the
        policy (``fallback`` under ``repair``).
        """

        def prepare() -> Call:
            lay = TokenLayout(input_ids, self.grammar, cu_seqlens)
            batch = normalize(features, items, lay.num_samples)
            emb = check_inputs(
                embeddings, input_ids, batch.features, loss_mask, labels, seq_first, lay
            )
            check_labels_dtype(labels, self.config.ignore_index)
            return Call(
                emb,
                input_ids,
                cu_seqlens,
                lay,
                batch,
                loss_mask,
                labels,
                seq_first,
                step,
                microbatch,
                encoder or self.encoder,
                fault_checks=fault_checks,
            )

        return self._guarded(prepare, step, microbatch, late=order)

    def last_stage(
        self,
        input_ids: torch.Tensor,
        items: Sequence[MediaItem],
        *,
        loss_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        step: int | None = None,
        microbatch: int | None = None,
        repairs: Literal["assume", "attempt"] = "assume",
        encoder: object | None = None,
        sample_ids: Sequence[str | int | None] | None = None,
        caller: str = "MediaGuard.last_stage",
    ) -> MergeResult:
        """The merge's decisions without features, for the last pipeline stage (which needs the
        loss mask) or any rank without the vision side. ``embeddings`` of the result is None.
        What it cannot see (NaN/Inf features, a repair that falls back: ``repairs="assume"``
        assumes success): docs/CONSENSUS.md, "The last pipeline stage".
        ``repairs="attempt"`` (no other stage merges: the collate check, an input rewrite):
        each planned repair is attempted here, by ``encoder.reprocess(repair, plan, batch,
        context)`` where given (the collate check's ``Reprocessor``), else it falls back with
        the reason. ``sample_ids``: per sample, the data pipeline's id for records of samples
        whose items carry none. ``caller``: the function named in errors of bad input.
        """

        def prepare() -> Call:
            lay = TokenLayout(input_ids, self.grammar, cu_seqlens)
            batch = metadata_batch(items, lay.num_samples)
            check_masks(loss_mask, labels, lay.batch, lay.row_length, None)
            check_labels_dtype(labels, self.config.ignore_index)
            return Call(
                None,
                input_ids,
                cu_seqlens,
                lay,
                batch,
                loss_mask,
                labels,
                False,
                step,
                microbatch,
                encoder,
                repairs,
                None if sample_ids is None else tuple(map(check_sample_id, sample_ids)),
            )

        return self._guarded(prepare, step, microbatch, caller)

    def keep_all(
        self,
        lay: TokenLayout,
        verdict: Verdict,
        *,
        loss_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        step: int | None = None,
        microbatch: int | None = None,
    ) -> MergeResult:
        """The aligned call of a check that verified the runs itself (the ``inputs`` mode): every
        sample kept and counted, the stage's round joined; nothing read from the device."""
        self.counters["merges"] += 1
        self.counters["samples"] += lay.num_samples
        plan = build_plan(lay.num_samples, (), verdict, None, self.config)
        stage = self.settle(LocalOutcome.of_plan(plan, step, microbatch))
        rep = GuardReport.of(
            plan,
            None,
            verdict,
            stage,
            step=step,
            microbatch=microbatch,
            rank=self.rank.rank,
            num_items=verdict.runs,
        )
        return MergeResult(None, loss_mask, labels, rep)

    def _guarded(
        self, prepare, step, microbatch, caller: str = "MediaGuard.merge", late=None
    ) -> MergeResult:
        """One guarded call: a library error gets the rank/step context, and any error raised
        before this rank's collective still joins it (:meth:`fail`)."""
        self.begin()
        try:
            if self.grammar.collapsed:
                raise MediaInputError(
                    f"grammar {self.grammar.name!r} is collapsed (one token per item, expanded by "
                    "the model): use the LLaVA adapter, not the generic merge"
                )
            return self._merge(prepare(), late)
        except MediaGuardError as err:
            if not err.context.get("where"):
                where = self.where(step, microbatch)
                err = err.with_context(f"{caller} ({where}): ", where=where)
            self.fail(err, step, microbatch)
            raise err from None
        except Exception as err:  # e.g. out of memory inside the checks: the peers must not hang
            self.fail(err, step, microbatch)
            raise

    def begin(self) -> None:
        """Starts a guarded call (adapters that plan themselves; then :meth:`settle` or
        :meth:`fail`)."""
        self._agreed = False

    def fail(self, err: BaseException, step: int | None, microbatch: int | None) -> None:
        """A guarded call failed on this rank before its collective (bad input, OOM): joins the
        stage's round as fatal, so the peers raise naming this rank instead of hanging until
        the process-group timeout. A no-op once agreed, or without a consensus."""
        if self._agreed or self.consensus is None:
            return
        self._agreed = True
        self.consensus.agree(
            LocalOutcome(
                step,
                microbatch,
                fatal=True,
                message=f"{type(err).__name__}: {err}",
                fault="data" if isinstance(err, MediaAlignmentError) else "call",
            )
        )

    def close(self) -> None:
        """Closes the per-rank log file (the guard stays usable: the file reopens lazily)."""
        self.log.close()

    def __enter__(self) -> MediaGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_step_end(self, step: int) -> dict[str, int]:
        """Counters since the last call, written as a ``step`` record, then reset (the drop
        budget checks them here)."""
        counts = dict(self.counters)
        hook = getattr(self.consensus, "on_step_end", None)
        if hook is not None:
            hook(step, counts, self)
        self.log.emit(GuardRecord(event="step", step=step, extra=counts))
        for k in self.counters:
            self.counters[k] = 0
        self.steps_ended += 1
        return counts

    # ---- internals --------------------------------------------------------------

    def where(self, step: int | None, microbatch: int | None) -> str:
        """``"rank 3, step 12, microbatch 0"``, as the record lines say it."""
        return where_text(self.rank.rank, step, microbatch)

    def _merge(self, c: Call, late: RunOrder | None = None) -> MergeResult:
        batch, lay = c.batch, c.lay
        order = batch.order
        known = self._codes  # modality -> code; an unknown one raises in modality_code
        codes = [known.get(it.modality) for it in batch.items]
        if None in codes:
            codes = [self.grammar.modality_code(it.modality) for it in batch.items]
        probe = batch.features if self.config.nonfinite != "off" and c.emb is not None else None
        if late is None:
            owning = [i for i in order if batch.items[i].num_features]  # featureless: no run
            tables = item_tables(
                [batch.items[i].num_features for i in owning],
                [codes[i] for i in owning],
                [batch.items[i].sample for i in owning] if batch.explicit else None,
                c.input_ids.device,
            )
            verdict, _ = verify(lay, tables, probe)
            groups = [(None, owning)]  # one scatter, or one per modality in its own order
            if len(tables) > 1:
                groups = [
                    (lay.code == t.code, [i for i in owning if codes[i] == t.code]) for t in tables
                ]
        else:  # items in consumption order, checked per modality (or ordered by the runs)
            verdict, order, batch, groups = verify_in_token_order(lay, batch, codes, late, probe)
            c = replace(c, batch=batch)  # cut by the counts read with the verdict, if any
            owning = [i for i in order if batch.items[i].num_features]
            if not verdict.aligned(len(owning)):  # the fault path reads them in token order
                c = replace(c, batch=in_token_order(batch, order, lay.num_samples))
                batch, order = c.batch, c.batch.order
        self.counters["merges"] += 1
        self.counters["samples"] += lay.num_samples
        found = None
        if verdict.aligned_but_nonfinite(len(owning)):  # a sum's NaN/Inf: confirm per item
            found = nonfinite_items(batch)
            if not found:
                verdict = replace(verdict, nonfinite=0, nonfinite_exact=True)
        if not verdict.aligned(len(owning)):
            return diagnose(self, c, verdict, found)
        plan = build_plan(lay.num_samples, batch.items, verdict, None, self.config)
        stage = self.settle(LocalOutcome.of_plan(plan, c.step, c.microbatch))
        out = c.emb  # None: the last stage; no features: no placeholder either (verified)
        if out is not None and owning:
            for k, (mask, mine) in enumerate(groups):
                src, lo = batch.features, mine[0] if mine else 0
                if mine == list(range(lo, lo + len(mine))):  # consecutive items: a view
                    src = src[batch.offsets[lo] : batch.offsets[lo + len(mine)]]
                else:  # out of token order
                    src = src.index_select(0, rows_index(batch, mine, src.device))
                # the first scatter copies the caller's embeddings, the next write into that copy
                out = scatter(out, lay.ph if mask is None else mask, src, inplace=k > 0)
        return self.result(c, out, plan, None, verdict, stage, None)

    def settle(self, local: LocalOutcome) -> StageOutcome:
        """Agrees this rank's outcome with its stage and raises here when any rank of the stage
        must, naming the culprit rank, step and sample (once per guarded call)."""
        self._agreed = True
        if self.consensus is not None:
            stage = self.consensus.agree(local)
        else:
            stage = StageOutcome.local(local, self.rank.rank)
        if not stage.fatal:
            return stage
        where = self.where(local.step, local.microbatch)
        if local.fatal and stage.culprit_rank in (None, self.rank.rank):
            raise MediaAlignmentError(
                local.message or "media alignment failed",
                context={"where": where, "sample": local.fatal_sample},
            )
        # the peer's branch of the error family: a data fault there is one here (a trainer
        # that skips it skips on every rank); its failed call stops this rank as it stopped it
        peer = MediaAlignmentError if stage.culprit_fault == "data" else ConsensusError
        raise peer(
            stage.peer_message(where),
            context={"where": where, "culprit_rank": stage.culprit_rank},
        )

    def result(self, c: Call, out, plan: Plan, report, verdict, stage, keep) -> MergeResult:
        """The result of a settled call: drops masked in the loss mask and labels."""
        loss_mask, labels = c.loss_mask, c.labels
        if plan.dropped:
            loss_mask, labels = mask_dropped(
                c.lay, keep, loss_mask, labels, self.config.ignore_index
            )
        if c.seq_first and out is not None:
            out = out.transpose(0, 1).contiguous()
        rep = GuardReport.of(
            plan,
            report,
            verdict,
            stage,
            step=c.step,
            microbatch=c.microbatch,
            rank=self.rank.rank,
            num_items=len(c.batch.items),
        )
        return MergeResult(out, loss_mask, labels, rep)
