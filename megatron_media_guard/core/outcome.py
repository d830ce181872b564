"""What a guarded merge returns, what one rank decided (:class:`LocalOutcome`), and what
its stage decided together (a :class:`Consensus`'s; without one, the local outcome)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from .alignment import AlignmentReport
from .plan import Plan
from .verify import Verdict

#: what made a rank fatal: a fault in its data (its peers raise ``MediaAlignmentError`` too) or
#: a failed call (a wrong call, out of memory: its peers raise ``ConsensusError``)
FaultKind = Literal["data", "call"]


@dataclass(frozen=True)
class LocalOutcome:
    """This rank's plan for one guarded merge, as plain data (a call that failed before it
    planned: the defaults, ``fatal`` and its ``message``)."""

    step: int | None
    microbatch: int | None
    digest: int = 0  # 63-bit plan digest: equal on ranks that hold the same micro-batch
    num_samples: int = 0
    mismatched: int = 0
    dropped: int = 0
    repaired: int = 0
    fatal: bool = False
    fatal_sample: int | None = None
    message: str | None = None  # the full diagnostic when fatal
    record: dict | None = None  # the JSONL record of the fatal event
    fault: FaultKind = "data"  # when fatal: what failed

    @classmethod
    def of_plan(
        cls,
        plan: Plan,
        step: int | None,
        microbatch: int | None,
        *,
        mismatched: int = 0,
        message: str | None = None,
        record: dict | None = None,
    ) -> LocalOutcome:
        """From the final plan; fatal when there is a ``message`` (the full diagnostic)."""
        return cls(
            step=step,
            microbatch=microbatch,
            digest=plan.digest,
            num_samples=len(plan.actions),
            mismatched=mismatched,
            dropped=len(plan.dropped),
            repaired=len(plan.repairs),
            fatal=message is not None,
            fatal_sample=plan.fatal[0] if plan.fatal else None,
            message=message,
            record=record,
        )


@dataclass(frozen=True)
class StageOutcome:
    """The decision every rank of the pipeline stage takes together."""

    fatal: bool
    culprit_rank: int | None = None
    culprit_sample: int | None = None
    culprit_step: int | None = None
    message: str | None = None  # the culprit's diagnostic (fetched from it when fatal)
    culprit_fault: FaultKind = "data"  # what failed on the culprit
    mismatched: int = 0
    dropped: int = 0
    repaired: int = 0
    collectives: int = 0  # how many collectives this agreement cost

    @classmethod
    def local(cls, out: LocalOutcome, rank: int | None) -> StageOutcome:
        return cls(
            fatal=out.fatal,
            culprit_rank=rank if out.fatal else None,
            culprit_sample=out.fatal_sample,
            culprit_step=out.step,
            message=out.message,
            culprit_fault=out.fault,
            mismatched=out.mismatched,
            dropped=out.dropped,
            repaired=out.repaired,
        )

    def peer_message(self, where: str) -> str:
        """What a rank (``where``) raises when a peer failed: the culprit's rank, step and
        sample, or what failed there."""
        msg = self.message or ""
        at = f"rank {self.culprit_rank} (step {self.culprit_step}"
        if self.culprit_sample is not None:
            head = f"Media alignment failed on {at}, sample {self.culprit_sample})"
            return f"{head}; this rank ({where}) stops with it.\n{msg}"
        first, _, rest = msg.partition("\n")
        head = f"The guarded merge failed on {at}): {first or 'no message'}"
        return f"{head}\nThis rank ({where}) stops with it." + (f"\n{rest}" if rest else "")


class Consensus(Protocol):
    def agree(self, local: LocalOutcome) -> StageOutcome: ...


@dataclass(frozen=True)
class GuardReport:
    """What one guarded merge found and did. ok: every sample aligned. actions: per sample.
    alignment: the per-sample report (None on the aligned path)."""

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
    #: (sample, positions in its row) of placeholders the policy generated (fed as text,
    #: or the reason of a drop / raise under ``GuardConfig.generated``)
    generated: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @classmethod
    def of(
        cls,
        plan: Plan,
        alignment: AlignmentReport | None,
        verdict: Verdict,
        stage: StageOutcome | None,
        *,
        step: int | None,
        microbatch: int | None,
        rank: int | None,
        num_items: int,
    ) -> GuardReport:
        """From the final plan (``alignment`` None: the aligned path)."""
        return cls(
            ok=alignment is None and plan.actions.count("keep") == len(plan.actions),
            step=step,
            microbatch=microbatch,
            rank=rank,
            num_samples=len(plan.actions),
            num_items=num_items,
            actions=plan.actions,
            dropped=plan.dropped,
            repaired=tuple(r.item for r in plan.repairs),
            alignment=alignment,
            verdict=verdict,
            digest=plan.digest,
            stage=stage,
            generated=plan.generated,
        )


@dataclass(frozen=True)
class MergeResult:
    """embeddings: like the input (``[b, s, h]`` or ``[s, b, h]``; None from
    :meth:`MediaGuard.last_stage`). loss_mask / labels: the caller's, with dropped samples
    zeroed / ignored (a loss mask is created when a sample is dropped and none was given)."""

    embeddings: torch.Tensor | None
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None
    report: GuardReport
