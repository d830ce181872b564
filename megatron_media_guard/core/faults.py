"""Item faults: what an adapter's own checks find where the run alignment cannot read the
tokens (megatron-core LLaVA's collapsed ``<image>`` tokens, its sound tokens), and their
records; the rest is :func:`~.fault_path.conclude`'s, as for every fault path."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..diagnostics import GuardRecord

Check = Literal["count", "tiles", "max_length", "nonfinite", "segment", "generated"]
FaultModality = Literal["image", "sound", "sample"]


@dataclass(frozen=True)
class ItemFault:
    """One finding in one sample. modality: ``image`` / ``sound`` (item: its index among the
    call's images / clips; None: none can be named) or ``sample`` (a packed sub-sample whose
    expansion does not fill its span). expected / got: the token side's and the media side's
    counts, rows or positions. tiles: the image's tile count, where it has one."""

    sample: int
    check: Check
    modality: FaultModality
    reason: str
    item: int | None = None
    item_in_sample: int | None = None
    expected: tuple[int, ...] = ()
    got: tuple[int, ...] = ()
    tiles: int | None = None


@dataclass(frozen=True)
class FaultContext:
    """What a call's records name beside the faults: the adapter, each sample's row and id,
    and per sample why it must raise where the policy said drop."""

    adapter: str
    row: Callable[[int], int]
    sample_id: Callable[[int], str | int | None]
    why_raise: Mapping[int, str]


def fault_records(
    faults: Sequence[ItemFault],
    actions: Sequence[str],
    ctx: FaultContext,
    *,
    step: int | None,
    microbatch: int | None,
) -> list[GuardRecord]:
    """One ``drop`` / ``raise`` record per fault (the sample's action decides which)."""
    out = []
    for f in faults:
        act = actions[f.sample]
        reason = f"{f.check}: {f.reason}"
        if f.sample in ctx.why_raise:
            reason += f" (raise: {ctx.why_raise[f.sample]})"
        out.append(
            GuardRecord(
                event="raise" if act == "raise" else "drop",
                step=step,
                microbatch=microbatch,
                sample=f.sample,
                sample_id=ctx.sample_id(f.sample),
                row=ctx.row(f.sample),
                item=f.item,
                modality=f.modality,
                expected=f.expected,
                got=f.got,
                first_mismatch=0 if f.check == "count" else None,
                tiles=f.tiles,
                action=act,  # type: ignore[arg-type]
                reason=reason,
                extra={"adapter": ctx.adapter, "check": f.check},
            )
        )
    return out


def batch_records(
    fatal: Sequence[str], notes: Sequence[str], adapter: str, step, microbatch
) -> list[GuardRecord]:
    """Records of the whole call's problems (``fatal``: raise) and ``notes`` (``check``), each
    ``"<check>: ..."``."""
    return [
        GuardRecord(
            event="raise" if bad else "check",
            step=step,
            microbatch=microbatch,
            action="raise" if bad else "unused",
            reason=text,
            extra={"adapter": adapter, "check": text.split(":")[0]},
        )
        for texts, bad in ((fatal, True), (notes, False))
        for text in texts
    ]


__all__ = ["Check", "FaultContext", "FaultModality", "ItemFault"]
