"""Per-rank consensus for the guarded merge: one small all-reduce per merge.

The *stage group* is every rank of one pipeline stage (tensor x data x context parallel);
the *micro-batch group*, the ranks of it holding the same micro-batch (tensor x context).
Aligned path: one ``all_reduce(SUM)`` of ``_FIELDS`` over the stage, whose check lanes cancel
exactly when every micro-batch group agrees on its plan digest and the stage is at one (step,
microbatch); else the slow path (``all_gather`` of a row per rank, the culprit's broadcast).
The protocol, payloads and messages: docs/CONSENSUS.md. Without torch.distributed (or a
stage of one) nothing is communicated.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..core.host import to_host
from ..core.outcome import LocalOutcome, StageOutcome
from ..diagnostics import DiagnosticsLog, GuardRecord, RankInfo
from ..errors import ConsensusError, MediaInputError

_LANE = (1 << 30) - 1
COUNTERS = ("samples", "mismatched", "dropped", "repaired")
_FIELDS = ("check0", "check1", *COUNTERS, "fatal")
_ROW = ("rank", "group", "digest", "fatal", "sample", "step", "microbatch", "samples")
_FATAL_CODE = {"data": 1, "call": 2}  # the row's "fatal": 0 = not fatal, else what failed


def dist_ready() -> bool:
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


def process_rank_info() -> RankInfo:
    """This process's global rank and tp/pp/dp/cp coordinates: torch.distributed and
    megatron-core ``parallel_state`` when initialized, else ``RANK`` from the environment."""
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
    """``len(ranks) - 1`` on the group's lowest rank, ``-1`` on the others (sum 0)."""
    return len(ranks) - 1 if rank == min(ranks) else -1


def check_values(
    digest: int, group: int, step: int | None, microbatch: int | None, coef: tuple[int, int]
) -> list[int]:
    """This rank's two check lanes, ``c_b * h(group, digest) + c_s * h(step, microbatch)``:
    summed over a stage, zero when every micro-batch group agrees on its digest and every
    rank is at the same (step, microbatch)."""

    def h(*parts: object) -> tuple[int, int]:
        v = int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")
        return v & _LANE, (v >> 30) & _LANE

    plan, where = h("plan", group, digest), h("where", step, microbatch)
    return [coef[0] * plan[k] + coef[1] * where[k] for k in (0, 1)]


def _none(v: int) -> int | None:
    return None if v < 0 else v


class StageConsensus:
    """Agrees each guarded merge across the ranks of one pipeline stage.

    stage_group: the stage's ranks; None: the world. batch_group: the ranks holding the same
    micro-batch; None: each rank alone (no digest check). rank_info: this rank's coordinates
    for records. budget: a :class:`~.budget.DropBudget` checked at step end. step_group: the
    ranks that stop together at step end (the pipeline group; counters MAX-combined over it).
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
        """Groups from megatron-core ``parallel_state`` (single process without torch.distributed)."""
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
        return self._info if self._info is not None else process_rank_info()

    def bind(self, guard: Any) -> StageConsensus:
        """Write ``consensus`` records to ``guard.log`` (the guard's per-rank file)."""
        self.log = getattr(guard, "log", None)
        return self

    # ---- the per-merge agreement ------------------------------------------------

    def agree(self, local: LocalOutcome) -> StageOutcome:
        """One all-reduce over the stage; ConsensusError on a plan disagreement; a fatal rank
        makes the outcome fatal on every rank."""
        self.totals["merges"] += 1
        counts = [local.num_samples, local.mismatched, local.dropped, local.repaired]
        if not self.active or self.stage_size == 1:
            for k, v in zip(COUNTERS, counts):
                self.totals[k] += v
            return StageOutcome.local(local, self.rank)
        start = self.collectives
        checks = check_values(local.digest, self.group_id, local.step, local.microbatch, self._coef)
        vals = self._all_reduce([*checks, *counts, int(local.fatal)], dist.ReduceOp.SUM)
        summed = dict(zip(_FIELDS, vals))
        for k in COUNTERS:  # each micro-batch group's ranks all counted the same micro-batch
            self.totals[k] += summed[k] // self.batch_size
        stage = {k: summed[k] // self.batch_size for k in ("mismatched", "dropped", "repaired")}
        if not (summed["fatal"] or summed["check0"] or summed["check1"]):
            return StageOutcome(fatal=False, collectives=1, **stage)
        rows = self._gather(local)
        disagree, culprits = _disagreements(rows, local)
        fatal = [r for r in rows if r["fatal"]]
        if not fatal:
            # the lanes did not cancel, yet every group agrees: the groups are inconsistent
            msg = "\n".join(disagree) or (
                f"Stage consensus failed (step {local.step}, microbatch {local.microbatch}): "
                "the check sums did not cancel although every micro-batch group agrees: the "
                "ranks were given inconsistent stage / micro-batch groups (every rank must pass "
                "the same layout, with micro-batch groups of one size)."
            )
            culprits = culprits or [-1]
            self._record(local, msg, rows, culprits, None)
            raise ConsensusError(
                msg, context={"culprit_rank": culprits[0], "disagreeing_ranks": culprits}
            )
        culprit = min(fatal, key=lambda r: r["rank"])
        got = [local.message, local.record] if self.rank == culprit["rank"] else [None, None]
        dist.broadcast_object_list(
            got, src=culprit["rank"], group=self.stage_group, device=self.device
        )
        self.collectives += 1
        message = got[0] or f"rank {culprit['rank']} reported a fatal alignment error"
        if disagree:
            message += "\n  (also: " + disagree[0] + ")"
        lines = message.splitlines()
        sample = _none(culprit["sample"])
        reason = (
            f"rank {culprit['rank']} raised (step {_none(culprit['step'])}"
            + (f", sample {sample}" if sample is not None else "")
            + "); the stage stops with it: "
            + (lines[1].strip() if len(lines) > 1 else lines[0])
        )
        self._record(local, reason, rows, [r["rank"] for r in fatal], got[1])
        return StageOutcome(
            fatal=True,
            culprit_rank=culprit["rank"],
            culprit_sample=sample,
            culprit_step=_none(culprit["step"]),
            message=message,
            culprit_fault="call" if culprit["fatal"] == _FATAL_CODE["call"] else "data",
            collectives=self.collectives - start,
            **stage,
        )

    def on_step_end(self, step: int, counts: Mapping[str, int], guard: Any = None) -> dict:
        """Stage-wide counters since the last step end (``agree`` summed them), MAX-combined
        over ``step_group``; checks the budget."""
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
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op, group=group if group is not None else self.stage_group)
        self.collectives += 1
        return (t if self.device is None else to_host(t, why="stage consensus")).tolist()

    def _gather(self, local: LocalOutcome) -> list[dict[str, int]]:
        row = [
            self.rank,
            self.group_id,
            local.digest,
            _FATAL_CODE[local.fault] if local.fatal else 0,
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

    def _record(self, local, message, rows, culprits, culprit_record) -> None:
        log = self.log or DiagnosticsLog(None, self.rank_info())
        log.emit(
            GuardRecord(
                event="consensus",
                step=local.step,
                microbatch=local.microbatch,
                sample=local.fatal_sample if local.fatal else None,
                action="raise",
                reason=message.splitlines()[0][:600],
                extra={
                    "culprit_ranks": culprits,
                    "digests": {str(r["rank"]): f"{r['digest']:#018x}" for r in rows},
                    "fatal_ranks": [r["rank"] for r in rows if r["fatal"]],
                    "culprit_record": culprit_record,
                },
            )
        )


def _odd_ones(values: dict[int, Any]) -> list[int]:
    """The ranks whose value differs from the most common one (a tie: the lowest rank's)."""
    counts = Counter(values.values())
    top = max(counts.values())
    ref = next(v for _, v in sorted(values.items()) if counts[v] == top)
    return [k for k, v in values.items() if v != ref]


def _disagreements(rows: list[dict[str, int]], local: LocalOutcome) -> tuple[list[str], list[int]]:
    """One line per disagreement (ranks at different merges; a micro-batch group's ranks at
    different plans) and the ranks that differ from the rest."""
    lines: list[str] = []
    culprits: list[int] = []
    at = f"step {local.step}, microbatch {local.microbatch}"
    where = {r["rank"]: (r["step"], r["microbatch"]) for r in rows}
    if len(set(where.values())) > 1:
        bad = _odd_ones(where)
        show = ", ".join(
            f"rank {k} at step {_none(s)} microbatch {_none(m)}" for k, (s, m) in where.items()
        )
        lines.append(
            f"Stage consensus failed ({at}): ranks of the stage are at different guarded merges "
            f"({show}); rank(s) {bad} differ from the rest (a rank skipped or added a merge)."
        )
        culprits += bad
    groups: dict[int, dict[int, int]] = {}
    for r in rows:
        groups.setdefault(r["group"], {})[r["rank"]] = r["digest"]
    for _, digests in sorted(groups.items()):
        if len(set(digests.values())) == 1:
            continue
        bad = _odd_ones(digests)
        view = ", ".join(f"rank {k} digest {v:#018x}" for k, v in digests.items())
        lines.append(
            f"Stage consensus failed ({at}): ranks {sorted(digests)} hold the same micro-batch "
            f"but reached different plans ({view}); rank(s) {bad} differ from "
            f"{'the majority' if len(digests) > 2 else 'the group'}. Tensor/context-parallel "
            "peers must see identical token ids and item metadata (num_features, sample, "
            "modality, frames, size); every rank of the stage stops here."
        )
        culprits += [k for k in bad if k not in culprits]
    return lines, culprits
