"""Per-rank consensus for the guarded merge (DESIGN §5): one small all-reduce per merge.

Groups. The *stage group* is every rank of one pipeline stage (tensor x data x context
parallel); the *micro-batch group* is the ranks of that stage holding the same
micro-batch (tensor x context parallel), a subset of it. No collective ever spans
pipeline stages inside the forward.

Aligned path: ONE ``all_reduce(SUM)`` of 7 int64 over the stage group::

    [check0, check1, samples, mismatched, dropped, repaired, fatal]

``check0/1`` are two 30-bit hash lanes that sum to zero exactly when every
micro-batch group agrees on its plan digest and the whole stage is at the same
(step, microbatch): a rank adds ``c_b * h(digest, group) + c_s * h(step, microbatch)``
with ``c_b = n - 1`` on the micro-batch group's first rank and ``-1`` on its other
``n - 1`` ranks (likewise ``c_s`` over the stage), so agreeing groups cancel; a
disagreement leaves a non-zero lane unless 60 hash bits collide. Counters are summed
over the stage and divided by ``n`` (peers count the same samples).

Slow path (a non-zero lane or a fatal rank; all ranks see the same sums, so all take
it): ``all_gather`` of 8 int64 per rank (rank, group, digest, fatal, sample, step,
microbatch, samples) names the disagreeing ranks; when a rank is fatal the culprit
(lowest fatal global rank) broadcasts its message and record
(``broadcast_object_list``), every rank writes a ``consensus`` record, and the merge
raises on every rank naming the culprit. A plan disagreement without a fatal rank
raises :class:`ConsensusError` on every rank of the stage.

Without torch.distributed initialized (or a stage of one rank) nothing is communicated.
This is the one module of the package (with the adapters) that touches
torch.distributed and megatron.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .alignment import align
from .diagnostics import DiagnosticsLog, GuardRecord, RankInfo
from .errors import ConsensusError, MediaAlignmentError, MediaInputError
from .explain import error_message, sample_record
from .host import to_host
from .items import MediaItem, normalize
from .outcome import LocalOutcome, StageOutcome
from .plan import Plan, build_plan
from .runs import TokenLayout, parse_layout
from .verify import verify

_LANE = (1 << 30) - 1
_FIELDS = ("check0", "check1", "samples", "mismatched", "dropped", "repaired", "fatal")
_ROW = ("rank", "group", "digest", "fatal", "sample", "step", "microbatch", "samples")
COUNTERS = ("samples", "mismatched", "dropped", "repaired")


def dist_ready() -> bool:
    """True when torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def parallel_state() -> Any | None:
    """megatron-core ``parallel_state`` when it is imported and initialized, else None
    (never imports megatron: a module nobody imported cannot be initialized)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not dist_ready():
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # an old or half-initialized parallel_state
        return None


def megatron_writers() -> tuple[object, ...]:
    """Megatron-LM's TensorBoard and W&B writers, where set (none outside Megatron-LM)."""
    gv = sys.modules.get("megatron.training.global_vars")
    out: list[object] = []
    for name in ("get_tensorboard_writer", "get_wandb_writer"):
        try:
            w = getattr(gv, name)() if gv is not None else None
        except Exception:  # not set up: Megatron asserts or returns None depending on version
            w = None
        if w is not None:
            out.append(w)
    return tuple(out)


def coefficients(rank: int, ranks: Sequence[int]) -> int:
    """``len(ranks) - 1`` on the group's lowest rank, ``-1`` on the others: they sum to 0."""
    return len(ranks) - 1 if rank == min(ranks) else -1


def check_values(
    digest: int, group: int, step: int | None, microbatch: int | None, coef: tuple[int, int]
) -> list[int]:
    """This rank's two check lanes: ``c_b * h(group, digest) + c_s * h(step, microbatch)``.

    Summed over a stage they are zero when every micro-batch group agrees on its digest and
    every rank is at the same (step, microbatch); |value| < 2**31 * (|c_b| + |c_s|).
    """

    def h(*parts: object) -> tuple[int, int]:
        v = int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")
        return v & _LANE, (v >> 30) & _LANE

    plan, where = h("plan", group, digest), h("where", step, microbatch)
    return [coef[0] * plan[k] + coef[1] * where[k] for k in (0, 1)]


def _none(v: int) -> int | None:
    return None if v < 0 else v


class StageConsensus:
    """Agrees each guarded merge across the ranks of one pipeline stage.

    stage_group: the stage's ranks (tensor x data x context parallel); None: the world.
    batch_group: ranks holding the same micro-batch (tensor x context parallel); None:
        each rank alone (no digest check).
    rank_info: this rank's coordinates for records (default: :meth:`rank_info`).
    budget: a :class:`~megatron_media_guard.budget.DropBudget` checked at step end.
    step_group: ranks that must stop together at step end (the pipeline group): the
        step-end counters are combined over it with MAX (one all-reduce, outside the
        forward), so stages without a merge raise with the stage that trips the budget.
    """

    def __init__(
        self,
        stage_group: Any = None,
        batch_group: Any = None,
        rank_info: RankInfo | None = None,
        *,
        budget: Any = None,
        step_group: Any = None,
    ) -> None:
        self._info = rank_info
        self.budget = budget
        self.log: DiagnosticsLog | None = None
        self.collectives = 0
        self.totals = dict.fromkeys((*COUNTERS, "merges"), 0)
        self.active = dist_ready()
        if budget is not None and getattr(budget, "writers", None) is None:
            budget.writers = megatron_writers
        if not self.active:
            self.rank, self.stage_size, self.batch_size = (rank_info or RankInfo()).rank, 1, 1
            self.stage_group = self.batch_group = self.step_group = self.device = None
            return
        self.rank = dist.get_rank()
        self.stage_group = stage_group if stage_group is not None else dist.group.WORLD
        self.batch_group = batch_group
        self.step_group = step_group
        stage_ranks = dist.get_process_group_ranks(self.stage_group)
        if self.rank not in stage_ranks:
            raise MediaInputError(f"rank {self.rank} is not in its stage group {stage_ranks}")
        self.stage_size = len(stage_ranks)
        c_s = coefficients(self.rank, stage_ranks)
        if batch_group is None:
            self.batch_size, self.group_id, c_b = 1, self.rank, 0
        else:
            batch_ranks = dist.get_process_group_ranks(batch_group)
            if self.rank not in batch_ranks or not set(batch_ranks) <= set(stage_ranks):
                raise MediaInputError(
                    f"micro-batch group {batch_ranks} of rank {self.rank} must contain it and lie "
                    f"within its stage group {stage_ranks}"
                )
            self.batch_size, self.group_id = len(batch_ranks), min(batch_ranks)
            c_b = coefficients(self.rank, batch_ranks)
        self._coef = (c_b, c_s)
        backend = str(dist.get_backend(self.stage_group))
        cuda = "nccl" in backend and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None

    # ---- constructors -----------------------------------------------------------

    @classmethod
    def from_parallel_state(cls, *, budget: Any = None) -> StageConsensus:
        """Groups from megatron-core ``parallel_state`` (0.14 .. 0.16+); single-process
        defaults when torch.distributed is not initialized."""
        if not dist_ready():
            return cls(budget=budget)
        ps = parallel_state()
        if ps is None:
            raise MediaInputError(
                "StageConsensus.from_parallel_state: torch.distributed is initialized but "
                "megatron-core parallel_state is not (call initialize_model_parallel first, or "
                "pass stage_group/batch_group explicitly)"
            )
        return cls(
            ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
            ps.get_tensor_and_context_parallel_group(),
            budget=budget,
            step_group=ps.get_pipeline_model_parallel_group(),
        )

    @classmethod
    def from_process_groups(cls, pgs: Any, *, budget: Any = None) -> StageConsensus:
        """Groups from a megatron-core ``ProcessGroupCollection`` (``tp_dp_cp``, ``tp_cp``, ``pp``)."""
        if not dist_ready():
            return cls(budget=budget)
        stage = getattr(pgs, "tp_dp_cp", None)
        if stage is None:
            raise MediaInputError("ProcessGroupCollection has no tp_dp_cp group")
        return cls(
            stage, getattr(pgs, "tp_cp", None), budget=budget, step_group=getattr(pgs, "pp", None)
        )

    def rank_info(self) -> RankInfo:
        """This rank's global rank and tp/pp/dp/cp coordinates (parallel_state when set)."""
        if self._info is not None:
            return self._info
        ps = parallel_state()
        if ps is not None:
            return RankInfo(
                rank=dist.get_rank(),
                tp=ps.get_tensor_model_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(),
                cp=ps.get_context_parallel_rank(),
            )
        return RankInfo(rank=dist.get_rank()) if dist_ready() else RankInfo.from_env()

    def bind(self, guard: Any) -> StageConsensus:
        """Write ``consensus`` records to ``guard.log`` (the guard's per-rank file)."""
        self.log = getattr(guard, "log", None)
        return self

    # ---- the per-merge agreement ------------------------------------------------

    def agree(self, local: LocalOutcome) -> StageOutcome:
        """One all-reduce over the stage (aligned path); raises ConsensusError on a plan
        disagreement; a fatal rank makes the returned outcome fatal on every rank."""
        self.totals["merges"] += 1
        if not self.active or self.stage_size == 1:
            for k in COUNTERS:
                self.totals[k] += local.num_samples if k == "samples" else getattr(local, k)
            return StageOutcome.local(local, self.rank)
        checks = check_values(local.digest, self.group_id, local.step, local.microbatch, self._coef)
        counts = [local.num_samples, local.mismatched, local.dropped, local.repaired]
        vals = self._all_reduce([*checks, *counts, int(local.fatal)], dist.ReduceOp.SUM)
        calls = 1
        summed = dict(zip(_FIELDS, vals))
        for k in COUNTERS:
            self.totals[k] += summed[k] // self.batch_size
        stage = {k: summed[k] // self.batch_size for k in ("mismatched", "dropped", "repaired")}
        if not (summed["fatal"] or summed["check0"] or summed["check1"]):
            return StageOutcome(fatal=False, collectives=calls, **stage)
        rows = self._gather(local)
        calls += 1
        disagree = _disagreements(rows)
        fatal = [r for r in rows if r["fatal"]]
        if not fatal:
            msg, culprits = _disagreement_message(disagree, local)
            self._record(local, "raise", msg, rows, culprits, None)
            raise ConsensusError(
                msg, context={"culprit_rank": culprits[0], "disagreeing_ranks": culprits}
            )
        culprit = min(fatal, key=lambda r: r["rank"])
        got = [local.message, local.record] if self.rank == culprit["rank"] else [None, None]
        dist.broadcast_object_list(
            got, src=culprit["rank"], group=self.stage_group, device=self.device
        )
        self.collectives += 1
        calls += 1
        message = got[0] or f"rank {culprit['rank']} reported a fatal alignment error"
        if disagree:
            note, _ = _disagreement_message(disagree, local)
            message += "\n  (also: " + note.splitlines()[0] + ")"
        lines = message.splitlines()
        reason = (
            f"rank {culprit['rank']} raised (step {_none(culprit['step'])}, sample "
            f"{_none(culprit['sample'])}); the stage stops with it: "
            + (lines[1].strip() if len(lines) > 1 else lines[0])
        )
        self._record(local, "raise", reason, rows, [r["rank"] for r in fatal], got[1])
        return StageOutcome(
            fatal=True,
            culprit_rank=culprit["rank"],
            culprit_sample=_none(culprit["sample"]),
            culprit_step=_none(culprit["step"]),
            message=message,
            collectives=calls,
            **stage,
        )

    def on_step_end(self, step: int, counts: Mapping[str, int], guard: Any = None) -> dict:
        """Stage-wide counters since the last step end (no collective for the data-parallel
        sum: ``agree`` already made it), combined over ``step_group``; checks the budget."""
        if guard is not None and self.log is None:
            self.bind(guard)
        totals, self.totals = dict(self.totals), dict.fromkeys(self.totals, 0)
        totals["local_merges"] = int(counts.get("merges", 0))
        pp = self.step_group
        if self.active and pp is not None and dist.get_world_size(pp) > 1:
            vals = self._all_reduce([totals[k] for k in COUNTERS], dist.ReduceOp.MAX, pp)
            totals.update(zip(COUNTERS, vals))
        if self.budget is not None:
            self.budget.on_step_end(step, totals, guard)
        return totals

    # ---- collectives ----------------------------------------------------------------

    def _all_reduce(self, values: Sequence[int], op: Any, group: Any = None) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        if self.device is not None:
            t = t.to(self.device)
        dist.all_reduce(t, op=op, group=group if group is not None else self.stage_group)
        self.collectives += 1
        return (t if self.device is None else to_host(t, why="stage consensus")).tolist()

    def _gather(self, local: LocalOutcome) -> list[dict[str, int]]:
        row = [
            self.rank,
            self.group_id,
            local.digest,
            int(local.fatal),
            -1 if local.fatal_sample is None else local.fatal_sample,
            -1 if local.step is None else local.step,
            -1 if local.microbatch is None else local.microbatch,
            local.num_samples,
        ]
        t = torch.tensor(row, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.stage_size)]
        dist.all_gather(out, t, group=self.stage_group)
        self.collectives += 1
        flat = torch.stack(out)
        flat = flat if self.device is None else to_host(flat, why="stage consensus table")
        return sorted((dict(zip(_ROW, r)) for r in flat.tolist()), key=lambda r: r["rank"])

    def _record(self, local, action, message, rows, culprits, culprit_record) -> None:
        log = self.log or DiagnosticsLog(None, self.rank_info())
        log.emit(
            GuardRecord(
                event="consensus",
                step=local.step,
                microbatch=local.microbatch,
                sample=local.fatal_sample if local.fatal else None,
                action=action,
                reason=message.splitlines()[0][:600],
                extra={
                    "culprit_ranks": culprits,
                    "digests": {str(r["rank"]): f"{r['digest']:#018x}" for r in rows},
                    "fatal_ranks": [r["rank"] for r in rows if r["fatal"]],
                    "culprit_record": culprit_record,
                },
            )
        )


def _majority(values: dict[int, Any]) -> Any:
    """The most common value; ties go to the value of the lowest rank."""
    counts = Counter(values.values())
    top = max(counts.values())
    return next(v for _, v in sorted(values.items()) if counts[v] == top)


def _disagreements(rows: list[dict[str, int]]) -> dict[str, Any]:
    """Which ranks differ from their micro-batch group (digest) or the stage (step)."""
    out: dict[str, Any] = {}
    where = {r["rank"]: (r["step"], r["microbatch"]) for r in rows}
    if len(set(where.values())) > 1:
        ref = _majority(where)
        out["where"] = (where, ref, [k for k, v in where.items() if v != ref])
    groups: dict[int, dict[int, int]] = {}
    for r in rows:
        groups.setdefault(r["group"], {})[r["rank"]] = r["digest"]
    for _, digests in sorted(groups.items()):
        if len(set(digests.values())) > 1:
            ref = _majority(digests)
            out.setdefault("plan", []).append(
                (digests, ref, [k for k, v in digests.items() if v != ref])
            )
    return out


def _disagreement_message(dis: dict[str, Any], local: LocalOutcome) -> tuple[str, list[int]]:
    lines: list[str] = []
    culprits: list[int] = []
    at = f"step {local.step}, microbatch {local.microbatch}"
    if "where" in dis:
        where, _, bad = dis["where"]
        show = ", ".join(
            f"rank {k} at step {_none(s)} microbatch {_none(m)}" for k, (s, m) in where.items()
        )
        lines.append(
            f"Stage consensus failed ({at}): ranks of the stage are at different guarded merges "
            f"({show}); rank(s) {bad} differ from the rest (a rank skipped or added a merge)."
        )
        culprits += bad
    for digests, _, bad in dis.get("plan", []):
        view = ", ".join(f"rank {k} digest {v:#018x}" for k, v in digests.items())
        lines.append(
            f"Stage consensus failed ({at}): ranks {sorted(digests)} hold the same micro-batch "
            f"but reached different plans ({view}); rank(s) {bad} differ from "
            f"{'the majority' if len(digests) > 2 else 'the group'}. Tensor/context-parallel "
            "peers must see identical token ids and item metadata (num_features, sample, "
            "modality, frames, size); every rank of the stage stops here."
        )
        culprits += [k for k in bad if k not in culprits]
    if not lines:  # the lanes did not cancel, yet every group agrees: groups are inconsistent
        lines.append(
            f"Stage consensus failed ({at}): the check sums did not cancel although every "
            "micro-batch group agrees: the ranks were given inconsistent stage / micro-batch "
            "groups (every rank must pass the same layout, with micro-batch groups of one size)."
        )
    return "\n".join(lines), culprits or [-1]


# ---- the last pipeline stage: the plan and loss mask from ids + item metadata -------------


@dataclass(frozen=True)
class LossMaskPlan:
    """The last stage's view of one micro-batch: the first stage's decisions, no features.

    loss_mask / labels: ``[b, s]``, dropped samples zeroed / ignored (None as given when
    nothing is dropped and none was given). stage: the consensus outcome (None: none ran).
    """

    plan: Plan
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None
    dropped: tuple[int, ...]
    stage: StageOutcome | None

    @property
    def digest(self) -> int:
        return self.plan.digest


def plan_loss_mask(
    guard: Any,
    input_ids: torch.Tensor,
    items: Sequence[MediaItem],
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    step: int | None = None,
    microbatch: int | None = None,
) -> LossMaskPlan:
    """The plan and loss mask the merge on the first stage reaches, from ids + item metadata.

    input_ids / loss_mask / labels: ``[b, s]`` (``[1, T]`` with ``cu_seqlens``). Same
    verdict (``verify`` without features), same ``build_plan``; repairs are assumed to
    succeed (the last stage has no vision tower). Equal digests with the first stage
    unless (a) a repair failed there and fell back, or (b) features held NaN/Inf
    (``nonfinite`` drops): the last stage cannot see either. Raises on every rank of
    the stage like the merge when the plan says raise.
    """
    if guard.grammar.collapsed:
        raise MediaInputError(
            f"grammar {guard.grammar.name!r} is collapsed: megatron-core LLaVA expands the last "
            "stage's labels and loss mask itself (use the LLaVA adapter)"
        )
    lay = TokenLayout(input_ids, guard.grammar, cu_seqlens)
    for name, t in (("loss_mask", loss_mask), ("labels", labels)):
        if t is not None and tuple(t.shape) != (lay.batch, lay.row_length):
            raise MediaInputError(
                f"{name} must be [b, s] = {(lay.batch, lay.row_length)}, got {tuple(t.shape)}"
            )
    batch = normalize([torch.empty(it.num_features, 0) for it in items], items, lay.num_samples)
    order = batch.order
    verdict = verify(
        lay,
        input_ids.reshape(-1),
        [batch.items[i].num_features for i in order],
        [guard.grammar.modality_code(batch.items[i].modality) for i in order],
        [batch.items[i].sample for i in order] if batch.explicit else None,
        None,
    )
    guard.counters["merges"] += 1
    guard.counters["samples"] += lay.num_samples
    report = None
    if verdict.aligned(len(batch.items)):
        plan = build_plan(lay.num_samples, batch.items, verdict, None, guard.config)
    else:
        report = align(parse_layout(lay), batch.items, explicit=batch.explicit)
        plan = build_plan(lay.num_samples, batch.items, verdict, report, guard.config)
        if plan.repairs:  # the first stage's digest after every repair succeeded
            plan = plan.with_actions(plan.actions, plan.repairs)
    fatal_msg, fatal_record = None, None
    if report is not None:
        for rep in report.mismatched:
            act = plan.actions[rep.sample]
            if act in ("drop", "raise"):
                rec = guard.log.emit(
                    sample_record(rep, batch.items, act, act, step=step, microbatch=microbatch)
                )
                fatal_record = fatal_record or (rec if act == "raise" else None)
        if plan.fatal or (report.orphans and guard.config.policy == "raise"):
            fatal_msg = error_message(
                report,
                plan.fatal,
                batch.items,
                where=_where(guard, step, microbatch),
                log_path=str(guard.log.path) if guard.log.path else None,
            )
    stage = _agree_or_raise(guard, plan, report, step, microbatch, fatal_msg, fatal_record)
    if report is not None:
        guard.counters["mismatched"] += len(report.mismatched)
        guard.counters["dropped"] += len(plan.dropped)
        guard.counters["repaired"] += len(plan.repairs)
    if plan.dropped:
        keep = torch.tensor(
            [a in ("keep", "repair") for a in plan.actions], device=input_ids.device
        )
        n = lay.num_samples
        tok = (~keep[lay.sample.clamp(max=n - 1)] & (lay.sample < n)).view(
            lay.batch, lay.row_length
        )
        base = loss_mask
        if base is None:
            base = torch.ones(lay.batch, lay.row_length, dtype=torch.float32, device=tok.device)
        loss_mask = base.masked_fill(tok, 0)
        if labels is not None:
            labels = labels.masked_fill(tok, guard.config.ignore_index)
    return LossMaskPlan(plan, loss_mask, labels, plan.dropped, stage)


def _where(guard: Any, step: int | None, microbatch: int | None) -> str:
    r = guard.rank.rank
    parts = [f"rank {r}" if r is not None else "single process (RANK unset)"]
    parts += [f"{k} {v}" for k, v in (("step", step), ("microbatch", microbatch)) if v is not None]
    return ", ".join(parts)


def _agree_or_raise(guard, plan: Plan, report, step, microbatch, fatal_msg, fatal_record):
    """The merge's agreement, for the last stage: the same outcome, the same raise."""
    local = LocalOutcome(
        step=step,
        microbatch=microbatch,
        digest=plan.digest,
        num_samples=len(plan.actions),
        mismatched=len(report.mismatched) if report is not None else 0,
        dropped=len(plan.dropped),
        repaired=len(plan.repairs),
        fatal=fatal_msg is not None,
        fatal_sample=plan.fatal[0] if plan.fatal else None,
        message=fatal_msg,
        record=fatal_record,
    )
    cons = guard.consensus
    stage = cons.agree(local) if cons is not None else StageOutcome.local(local, guard.rank.rank)
    if not stage.fatal:
        return stage
    where = _where(guard, step, microbatch)
    if fatal_msg is not None and stage.culprit_rank in (None, guard.rank.rank):
        raise MediaAlignmentError(fatal_msg, context={"where": where, "sample": local.fatal_sample})
    raise MediaAlignmentError(
        f"Media alignment failed on rank {stage.culprit_rank} (step {stage.culprit_step}, "
        f"sample {stage.culprit_sample}); this rank stops with it.\n{stage.message or ''}",
        context={"where": where, "culprit_rank": stage.culprit_rank},
    )
