"""The aligned-path check: one fixed-size verdict, one device-to-host transfer.

Instead of bringing runs to the host, the expected item table (known on the host)
goes to the device and every run is checked against it there. Item ``r`` (in token
order) must own the ``r``-th run: its run ends where the cumulative placeholder
count reaches ``cum[r + 1]``, it starts in sample ``sample[r]`` and has modality
``modality[r]``. What comes back is a handful of integers, whatever the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from .host import to_host
from .runs import TokenLayout

# multiplier for the token-id fingerprint (odd 63-bit constant; wraps mod 2**64)
_MIX = 0x5851F42D4C957F2D


@dataclass(frozen=True)
class Verdict:
    """What the device found, as host integers.

    runs: placeholder runs found. bad_runs: runs that disagree with their expected item
    (length, modality, sample) or have none. findings: malformed positions.
    nonfinite: 1 when any feature is NaN/Inf (0 when not checked).
    fingerprint: a hash of the token ids, so ranks holding the same micro-batch can prove it.
    """

    runs: int
    bad_runs: int
    findings: int
    nonfinite: int
    fingerprint: int

    def aligned(self, num_items: int) -> bool:
        return (
            self.runs == num_items
            and self.bad_runs == 0
            and self.findings == 0
            and self.nonfinite == 0
        )


def verify(
    lay: TokenLayout,
    ids_flat: torch.Tensor,
    lengths: list[int],
    modalities: list[int],
    samples: list[int] | None,
    features: torch.Tensor | None,
) -> Verdict:
    """Checks every run against the expected items (token order), entirely on device.

    lengths/modalities/samples: per item in token order (samples None: not checked).
    features: ``[sum(n), h]`` to check for NaN/Inf, or None to skip that read.
    """
    dev = ids_flat.device
    n_items = len(lengths)
    start, end = lay.run_bounds()  # [b, s]
    violations = lay.structure_violations(start, end)
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    if n_items:
        ends = torch.tensor(list(accumulate(lengths)), dtype=torch.int64).to(dev, non_blocking=True)
        # items are concatenated across rows in token order: scan the flattened batch
        run_idx = (torch.cumsum(start.view(-1), 0) - 1).view_as(start)  # run of each token
        ph_cum = torch.cumsum(lay.ph.view(-1), 0).view_as(start)  # placeholders so far
        r = run_idx.clamp(0, n_items - 1)
        # run r ends where the placeholder count reaches item r's cumulative length
        bad = (end & ((run_idx >= n_items) | (ph_cum != torch.take(ends, r)))).sum()
        if len(lay.grammar.placeholders) > 1:
            mods = torch.tensor(modalities, dtype=torch.int64).to(dev, non_blocking=True)
            bad = bad + (start & (lay.run_codes(start) != torch.take(mods, r))).sum()
        if samples is not None:
            # items come sorted by sample and runs in token order, so run r lies in item r's
            # sample for every r iff each sample holds as many runs as it has items
            want = torch.bincount(torch.tensor(samples), minlength=lay.num_samples)
            bad = bad + (lay.runs_per_sample(start) != want.to(dev, non_blocking=True)).sum()
    else:
        bad = zero
    if features is not None and features.numel():
        # min and max propagate NaN and show +-Inf: one cheap reduction over the features
        lo, hi = torch.aminmax(features)
        nonfinite = (~(torch.isfinite(lo) & torch.isfinite(hi))).to(torch.int64)
    else:
        nonfinite = zero
    pos = torch.arange(ids_flat.numel(), device=dev)
    fingerprint = ((ids_flat.to(torch.int64) + 1) * (pos * _MIX + 1)).sum()
    packed = torch.stack([start.sum(), bad, violations, nonfinite.to(dev), fingerprint])
    # the one host sync of the aligned path: five integers decide keep-all or diagnose
    vals = to_host(packed, why="aligned-path verdict").tolist()
    return Verdict(*vals)
