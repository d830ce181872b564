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

from . import verify_lut
from .host import scalars_to_host, to_host
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
    nonfinite_exact: bool = True  # False: ``nonfinite`` came from a sum that may overflow

    def aligned_but_nonfinite(self, num_items: int) -> bool:
        """Only the NaN/Inf flag fails, and that flag may be a finite sum's overflow."""
        return (
            bool(self.nonfinite)
            and not self.nonfinite_exact
            and self.runs == num_items
            and (self.bad_runs == 0 and self.findings == 0)
        )

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
    ids64 = ids_flat if ids_flat.dtype == torch.int64 else ids_flat.to(torch.int64)
    luts = verify_lut.tables(lay.grammar, lay.packed, lay.row_length, dev)
    runs = None  # a host int from the marker check (CPU), else read with the verdict
    if luts is not None:
        runs, parts, lay.ph = verify_lut.check(
            ids64.view(lay.batch, lay.row_length),
            luts,
            _want_keys(lengths, modalities, samples, lay, dev),
            n_items,
            samples is not None,
        )
    else:
        parts = _general(lay, lengths, modalities, samples, dev)
    probe = _finite_probe(features) if features is not None and features.numel() else None
    if probe is not None:
        parts.append(probe[0])
    w_sum = _fingerprint(ids64, parts)
    # the one host sync of the aligned path: a handful of integers decide keep-all or diagnose
    vals = scalars_to_host(parts, dev, why="aligned-path verdict")
    if runs is not None:  # the scan's min and max decide the structure
        lo, hi, *rest = vals
        findings = verify_lut.findings(lo, hi)
    else:
        runs, findings, *rest = vals
    bad_runs = rest.pop(0) if n_items else 0
    return _verdict(runs, bad_runs, findings, rest, probe, w_sum)


def verify_with(
    lay: TokenLayout, ids_flat: torch.Tensor, extra: torch.Tensor, features: torch.Tensor | None
) -> tuple[Verdict, list[int]]:
    """The verdict of a call whose items the caller checks against the runs on the host (their
    token order is decided from the runs: ``interleave.verify_in_token_order``): the run count,
    the structure, the NaN/Inf flag and the fingerprint, with ``extra`` (``[n]`` int64 on the
    device: the first runs) read in the same one transfer. ``bad_runs`` is 0: the caller's."""
    ids64 = ids_flat if ids_flat.dtype == torch.int64 else ids_flat.to(torch.int64)
    start, end = lay.run_bounds()
    parts = [torch.count_nonzero(start), lay.structure_violations(start, end)]
    probe = _finite_probe(features) if features is not None and features.numel() else None
    if probe is not None:
        parts.append(probe[0])
    w_sum = _fingerprint(ids64, parts)
    flat = torch.cat([torch.stack([p.to(torch.int64) for p in parts]), extra.to(torch.int64)])
    # the one host sync of the aligned path: the verdict and the runs that order the items
    vals = to_host(flat, why="aligned-path verdict").tolist()
    head, tail = vals[: len(parts)], vals[len(parts) :]
    runs, findings, *rest = head
    return _verdict(runs, 0, findings, rest, probe, w_sum), tail


def _fingerprint(ids64: torch.Tensor, parts: list[torch.Tensor]) -> int:
    """Appends the fingerprint's device part to ``parts``; returns its host part."""
    dev = ids64.device
    w, w_sum = fingerprint_weights(ids64.numel(), dev)
    # + w_sum on the host: sum((ids + 1) * w), wrapping (CPU has an int64 dot; CUDA not)
    parts.append(torch.dot(ids64, w) if dev.type == "cpu" else (ids64 * w).sum())
    return w_sum


def _verdict(runs, bad_runs, findings, rest: list, probe, w_sum: int) -> Verdict:
    """The verdict from the values read back after runs / findings / bad runs: the NaN/Inf
    probe's (when checked), then the fingerprint's."""
    nonfinite = int(probe[1](rest.pop(0))) if probe is not None else 0
    fingerprint = (rest[0] + w_sum + 2**63) % 2**64 - 2**63  # int64 wraparound
    exact = probe is None or probe[2]
    return Verdict(runs, bad_runs, findings, nonfinite, fingerprint, exact)


# bf16 / fp32: the bits of the sum (float32 accumulation; twice as fast as aminmax on CPU):
# NaN/Inf anywhere makes it NaN/Inf; a finite sum that overflows is a false alarm, which the
# caller rules out with the exact per-item check before it acts (``nonfinite_exact`` False)
_SUM_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float32: (torch.int32, 0x7F800000)}


def _finite_probe(features: torch.Tensor):
    """``(device scalar, host decoder -> 1 if NaN/Inf, exact)`` for the features."""
    bits = _SUM_BITS.get(features.dtype)
    if bits is not None:
        view, mask = bits
        return features.sum().view(view), lambda v: v & mask == mask, False
    # min and max propagate NaN and show +-Inf: one cheap reduction over the features
    lohi = torch.count_nonzero(torch.isfinite(torch.stack(torch.aminmax(features))))
    return lohi, lambda v: v != 2, True


def _general(lay, lengths, modalities, samples, dev) -> list[torch.Tensor]:
    """Device scalars ``[runs, structure violations, (bad runs)]`` for any grammar."""
    n_items = len(lengths)
    start, end = lay.run_bounds()  # [b, s]
    parts = [torch.count_nonzero(start), lay.structure_violations(start, end)]
    if n_items:
        # a run is one modality (breaks come with one modality only), its last token included:
        # run r must end where the placeholder count reaches item r's cumulative length, with
        # item r's modality, checked at once as count * K + code (entries 0 and n + 1: no run)
        k = len(lay.grammar.placeholders)
        want = [-1, *(e * k + m for e, m in zip(accumulate(lengths), modalities)), -1]
        head = len(want)
        if samples is not None:
            counts = [0] * lay.num_samples
            for smp in samples:
                counts[smp] += 1
            want += counts
        table = _constant(tuple(want), dev)
        # items are concatenated across rows in token order: scan the flattened batch
        run_no = torch.cumsum(start.view(-1), 0).view_as(start).clamp_(max=n_items + 1)  # 1-based
        got = torch.cumsum(lay.ph.view(-1), 0).view_as(start)  # placeholders so far
        if k > 1:
            got = got * k + lay.modality_key
        bad = torch.count_nonzero(end & (got != torch.take(table[:head], run_no)))
        if samples is not None:
            # items come sorted by sample and runs in token order, so run r lies in item r's
            # sample for every r iff each sample holds as many runs as it has items
            want_runs = table[len(want) - lay.num_samples :]
            bad = bad + torch.count_nonzero(lay.runs_per_sample(start) != want_runs)
        parts.append(bad)
    return parts


def _want_keys(lengths, modalities, samples, lay: TokenLayout, dev) -> torch.Tensor | None:
    """Item r's key for :func:`verify_lut.check` (modality + 1, length, sample), cached."""
    if not lengths:
        return None
    s = lay.row_length
    row = 8 * (s + 2)
    smp = samples if samples is not None else [0] * len(lengths)
    # a length past the row is capped at s + 1, which no run has: uncapped, 8 * n could
    # reach into the next row's keys (n = s + 3 in sample 0 reads as 1 in sample 1)
    keys = tuple([m + 1 + 8 * min(n, s + 1) + row * r for n, m, r in zip(lengths, modalities, smp)])
    return _constant(keys, dev)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(values: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``dev``, kept for the last few (a run repeats its items)."""
    key = (values, dev)
    got = _CONSTANTS.get(key)
    if got is None:
        if len(_CONSTANTS) >= 32:
            _CONSTANTS.pop(next(iter(_CONSTANTS)))
        got = _CONSTANTS[key] = torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)
    return got


_WEIGHTS: dict[tuple[int, torch.device], tuple[torch.Tensor, int]] = {}


def fingerprint_weights(n: int, dev: torch.device) -> tuple[torch.Tensor, int]:
    """``arange(n) * _MIX + 1`` (int64, wrapping), the fingerprint's per-position weights, and
    their sum as a host int; kept for the last few (size, device) pairs (a training run
    repeats its shapes)."""
    key = (n, dev)
    got = _WEIGHTS.get(key)
    if got is None:
        if len(_WEIGHTS) >= 8:
            _WEIGHTS.pop(next(iter(_WEIGHTS)))
        w = torch.arange(n, device=dev) * _MIX + 1
        got = _WEIGHTS[key] = (w, _MIX * (n * (n - 1) // 2) + n)  # sum(w), exact mod 2**64
    return got
