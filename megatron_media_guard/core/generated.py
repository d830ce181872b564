"""Placeholders the policy generated (RL rollouts): under the loss and outside every
start/end region (a grammar without both markers: under the loss alone). Such a token always
fails the aligned check, so nothing here runs on the aligned path. What is found and what
``GuardConfig.generated`` does with it: docs/DIAGNOSTICS.md."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..diagnostics import GuardRecord
from .host import to_host
from .parsed import FindingKind
from .runs import TokenLayout
from .validate import check_masks

TEXT_REASON = "generated placeholder fed as text"


@dataclass(frozen=True)
class GeneratedSample:
    """One sample's generated placeholders: its row and their positions in that row."""

    sample: int
    row: int
    positions: tuple[int, ...]

    def describe(self) -> str:
        pos = list(self.positions[:16])
        more = f" and {len(self.positions) - 16} more" if len(self.positions) > 16 else ""
        return f"row {self.row} positions {pos}{more}"


@dataclass(frozen=True)
class Generated:
    """``mask`` ``[b, s]`` on the ids' device, and per sample where they are."""

    mask: torch.Tensor
    samples: tuple[GeneratedSample, ...]

    def of(self, sample: int) -> GeneratedSample | None:
        return next((g for g in self.samples if g.sample == sample), None)

    @classmethod
    def grouped(cls, mask: torch.Tensor, hits: Iterable[tuple[int, int, int]]) -> Generated:
        """``(row, column, sample)`` hits grouped by sample (its row: its first hit's)."""
        by: dict[int, tuple[int, list[int]]] = {}
        for row, col, s in hits:
            by.setdefault(s, (row, []))[1].append(col)
        return cls(mask, tuple(GeneratedSample(s, r, tuple(c)) for s, (r, c) in sorted(by.items())))

    def reasons(self, action: str) -> dict[int, str]:
        """sample -> why it is dropped / raised (``action``), naming the positions."""
        verb = {"drop": "dropped", "raise": "raised"}.get(action, action)
        return {
            g.sample: f"generated placeholder at {g.describe()} (under the loss, outside any "
            f"media region; GuardConfig.generated={action!r}: sample {verb})"
            for g in self.samples
        }


def find_generated(
    lay: TokenLayout,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    ignore_index: int,
) -> Generated | None:
    """The generated placeholders of ``lay`` (None: none), in one transfer sized by them.
    With both labels and a loss mask, both must train on a position (Megatron's loss mask
    masks; a mask of ones next to Hugging Face labels leaves the labels in charge)."""
    check_masks(loss_mask, labels, lay.batch, lay.row_length, None)
    if labels is None and loss_mask is None:
        return None
    loss = labels != ignore_index if labels is not None else None
    if loss_mask is not None:
        lm = loss_mask != 0
        loss = lm if loss is None else loss & lm.to(loss.device)
    loss = loss.to(lay.device)
    ph = lay.ph
    if lay.packed:
        ph = ph & (lay.sample < lay.num_samples)  # padding placeholders are never merged
    mask = ph & loss
    g = lay.grammar
    if g.start_id is not None and g.end_id is not None:  # outside every region
        start, end = lay.run_bounds()
        mask = mask & (lay.finding_codes(start, end) == int(FindingKind.OUTSIDE_REGION))
        untrained = None
    else:  # no regions: the placeholders the loss does not train on (0: it tells none apart)
        untrained = (ph & ~loss).sum()
    pos = torch.nonzero(mask)
    smp = lay.sample[pos[:, 0], pos[:, 1]]
    table = torch.cat([pos, smp[:, None]], 1)
    head = pos.new_ones(1, 3) if untrained is None else untrained.reshape(1, 1).expand(1, 3)
    host = to_host(torch.cat([head, table]), why="positions of generated placeholders").tolist()
    rows = host[1:]
    if not rows or host[0][0] == 0:  # none, or a loss that trains on every placeholder
        return None
    return Generated.grouped(mask, rows)


def as_text(
    input_ids: torch.Tensor, gen: Generated, text_id: int, cu_seqlens: torch.Tensor | None, grammar
) -> tuple[torch.Tensor, TokenLayout]:
    """``input_ids`` with the generated placeholders as ``text_id`` (out of place), its layout."""
    ids = input_ids.masked_fill(gen.mask.reshape(input_ids.shape), text_id)
    return ids, TokenLayout(ids, grammar, cu_seqlens)


def text_records(
    gen: Generated,
    step: int | None,
    microbatch: int | None,
    text_id: int,
    kept: set[int],
) -> list[GuardRecord]:
    """A ``check`` record (action ``text``) per ``kept`` sample whose generated placeholders
    were fed as text."""
    return [
        GuardRecord(
            event="check",
            step=step,
            microbatch=microbatch,
            sample=g.sample,
            row=g.row,
            action="text",
            reason=f"{TEXT_REASON} at {g.describe()}",
            extra={"positions": list(g.positions[:4096]), "text_id": text_id},
        )
        for g in gen.samples
        if g.sample in kept
    ]
