"""The ``inputs`` mode's aligned-path check: per-item counts that stay on the device.

Where the items are sized from the inputs themselves (grid rows, audio masks: a family's
``counts``), their table is computed on the device and never read on the aligned path: each
modality's runs are checked against its table there, and the one transfer is the verdict.
Item ``r`` of a modality owns ``runs[r]`` consecutive runs of that modality (token order
over the flattened batch), each of ``tokens[r]`` placeholders: the ``j``-th run of item ``r``
must end where the modality's placeholder count reaches the item's cumulative size. The run
counts must agree, and a run of a modality no table covers is bad. The host reads the tables
only when the verdict says the call is not aligned (the fault path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .host import scalars_to_host
from .runs import TokenLayout
from .verify import Verdict, fingerprint_weights

# odd 63-bit multiplier for the tables' part of the fingerprint
_MIX_TABLE = 0x2545F4914F6CDD1D


@dataclass(frozen=True)
class Expected:
    """One modality's items as the device holds them (``[n]`` int64 each, on the ids' device).

    code: the modality's code in the grammar; runs / tokens: per item its runs and the
    placeholders of each; samples: per item its sample (explicit items: each sample then
    holds as many runs as its items own), else None; declared: per item the features the
    caller's items declare (must equal ``runs * tokens``), else None.
    """

    code: int
    runs: torch.Tensor
    tokens: torch.Tensor
    samples: torch.Tensor | None = None
    declared: torch.Tensor | None = None


def verify_counts(
    lay: TokenLayout,
    ids: torch.Tensor,
    expected: Sequence[Expected],
    extra: Sequence[torch.Tensor] = (),
) -> tuple[Verdict, list[int]]:
    """The verdict of every run against ``expected``, in one transfer, with the 0-d device
    integers ``extra`` (the caller's own input checks) read in the same transfer. The
    verdict's ``bad_runs`` counts every disagreement (its ``runs`` is what the ids hold);
    its fingerprint hashes the ids and the tables, so ranks holding the same micro-batch
    agree on it."""
    dev = ids.device
    start, end = lay.run_bounds()
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    n_runs = torch.count_nonzero(start)
    findings = lay.structure_violations(start, end).to(torch.int64)
    bad, want_total, fp = zero, zero, zero
    for e in expected:
        is_m = lay.code == e.code
        start_m, end_m = start & is_m, end & is_m
        size = e.tokens.to(dev, torch.int64)
        per_row = torch.where(size > 0, e.runs.to(dev, torch.int64), 0)  # featureless: no run
        if per_row.numel() == 0:
            continue  # its runs are counted by the total below
        cum_runs = torch.cumsum(per_row, 0)
        want_total = want_total + cum_runs[-1]
        base = torch.cumsum(per_row * size, 0) - per_row * size
        run_idx = torch.cumsum(start_m.reshape(-1), 0) - 1
        ph_cum = torch.cumsum(is_m.reshape(-1), 0)
        row = torch.searchsorted(cum_runs, run_idx, right=True).clamp(max=per_row.numel() - 1)
        within = run_idx - (cum_runs[row] - per_row[row])
        want = base[row] + size[row] * (within + 1)
        late = run_idx >= cum_runs[-1]
        bad = bad + torch.count_nonzero(end_m.reshape(-1) & (late | (ph_cum != want)))
        bad = bad + (torch.count_nonzero(start_m) != cum_runs[-1]).long()
        bad = bad + _items_across_samples(lay, start_m, per_row, cum_runs)
        if e.samples is not None:
            want_s = torch.zeros(lay.num_samples, dtype=torch.int64, device=dev)
            want_s.index_add_(0, e.samples.to(dev, torch.int64), per_row)
            bad = bad + torch.count_nonzero(lay.runs_per_sample(start_m) != want_s)
        if e.declared is not None:
            bad = bad + torch.count_nonzero(e.declared.to(dev, torch.int64) != per_row * size)
        table = torch.stack([per_row, size], 1)
        w = torch.arange(table.numel(), device=dev).view_as(table) * _MIX_TABLE + e.code + 1
        fp = fp + (table * w).sum()
    bad = bad + (n_runs != want_total).long()  # runs of a modality no table covers
    ids64 = ids.reshape(-1).to(torch.int64)
    w, w_sum = fingerprint_weights(ids64.numel(), dev)
    fp = fp + (torch.dot(ids64, w) if dev.type == "cpu" else (ids64 * w).sum())
    parts = [n_runs, findings, bad, fp, *(x.to(torch.int64) for x in extra)]
    # the one host sync of the inputs mode's aligned path: the verdict and the caller's checks
    runs, found, bad_runs, fp_host, *rest = scalars_to_host(parts, dev, why="aligned-path verdict")
    fingerprint = (fp_host + w_sum + 2**63) % 2**64 - 2**63  # int64 wraparound
    return Verdict(runs, bad_runs, found, 0, fingerprint), rest


def _items_across_samples(
    lay: TokenLayout, run_start: torch.Tensor, per_row: torch.Tensor, cum_runs: torch.Tensor
) -> torch.Tensor:
    """Device scalar: sample boundaries that fall inside an item's runs (a video's temporal
    groups fed to two samples): each run may count right, but one item never feeds two
    samples. In run-index space: sample ``k`` starts after ``before[k]`` runs of the
    modality; item ``r`` holds runs ``[cum_runs[r] - per_row[r], cum_runs[r])``."""
    counts = lay.runs_per_sample(run_start)
    before = torch.cumsum(counts, 0) - counts
    row = torch.searchsorted(cum_runs, before, right=True)
    inside = row < cum_runs.numel()
    row = row.clamp(max=cum_runs.numel() - 1)
    return torch.count_nonzero(inside & (before > cum_runs[row] - per_row[row]))


__all__ = ["Expected", "verify_counts"]
