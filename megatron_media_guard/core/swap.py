"""Swap suspicion: sample A's item fed to B and B's to A passes every total, and a
re-projection would "fix" each by resizing it to the other's run. Such samples take the
fallback, never a repair."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from .alignment import AlignmentReport, Status

SWAP_REASON = "suspected swap"


def suspected_swaps(report: AlignmentReport, statuses: Collection[Status]) -> dict[int, str]:
    """Samples (with ``statuses``) whose mismatches exchanged items explain, and why: an
    item as long as another sample's mismatched run (same modality), or mismatched runs and
    items that agree as multisets over two or more samples."""
    pairs = [
        (rep.sample, exp, got, mod)
        for rep in report.mismatched
        if rep.status in statuses
        for exp, got, mod in zip(rep.expected, rep.got, rep.item_modalities)
        if exp != got
    ]
    out: dict[int, str] = {}
    for smp, _, got, mod in pairs:
        other = next((o for o, exp, _, m in pairs if o != smp and m == mod and exp == got), None)
        if other is not None:
            out[smp] = (
                f"{SWAP_REASON}: an item of sample {smp} has {got} features, the length of a "
                f"mismatched run of sample {other}"
            )
    samples = sorted({smp for smp, *_ in pairs})
    if len(samples) > 1:
        runs = Counter((exp, mod) for _, exp, _, mod in pairs)
        feats = Counter((got, mod) for _, _, got, mod in pairs)
        if runs == feats:
            for smp in samples:
                out.setdefault(
                    smp,
                    f"{SWAP_REASON}: the mismatched runs of samples {samples} and their items' "
                    "feature counts agree as multisets, paired differently",
                )
    return dict(sorted(out.items()))
