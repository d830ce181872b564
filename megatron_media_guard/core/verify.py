"""The aligned-path check: every run against per-modality count tables on the device, one
fixed-size verdict, one device-to-host transfer.

Item ``r`` of a modality's table (:class:`Expected`, token order) owns ``runs[r]``
consecutive runs of that modality, the ``j``-th ending where the modality's placeholder
count reaches the item's cumulative size; the run counts must agree, a run no table covers
is bad, and no item feeds two samples. The order across modalities is never checked: the
scatter is per modality too. Marker grammars on CPU take ``verify_lut``'s fused check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import verify_lut
from .cache import constant, kept
from .host import scalars_to_host
from .runs import TokenLayout

# multipliers of the fingerprint: the token ids', the tables' (odd 63-bit; wrap mod 2**64)
_MIX = 0x5851F42D4C957F2D
_MIX_TABLE = 0x2545F4914F6CDD1D


@dataclass(frozen=True)
class Verdict:
    """What the device found, as host integers: runs found, runs that disagree with their
    item (or have none), malformed positions, 1 when any feature is NaN/Inf, and a hash of
    the ids and the tables (ranks holding the same micro-batch prove it)."""

    runs: int
    bad_runs: int
    findings: int
    nonfinite: int
    fingerprint: int
    nonfinite_exact: bool = True  # False: ``nonfinite`` came from a sum that may overflow

    def aligned_but_nonfinite(self, num_items: int) -> bool:
        """Only the NaN/Inf flag fails, and that flag may be a finite sum's overflow."""
        return (
            self.structure_aligned(num_items) and bool(self.nonfinite) and not self.nonfinite_exact
        )

    def aligned(self, num_items: int) -> bool:
        return self.structure_aligned(num_items) and self.nonfinite == 0

    def structure_aligned(self, num_items: int) -> bool:
        """Every run agrees with its item, the structure is sound (NaN/Inf aside)."""
        return self.runs == num_items and self.bad_runs == 0 and self.findings == 0


@dataclass(frozen=True)
class Expected:
    """One modality's items on the ids' device (``[n]`` int64 each): its grammar code; per
    item its runs, the placeholders of each, its sample (None: not checked) and its declared
    features (must equal ``runs * tokens``; None: not checked). where: the positions its runs
    may stand at (a shared token told apart by type; None: all of ``code``). known:
    ``(lengths, samples, fingerprint part)`` where the host has them (one run per item)."""

    code: int
    runs: torch.Tensor
    tokens: torch.Tensor
    samples: torch.Tensor | None = None
    declared: torch.Tensor | None = None
    known: tuple[tuple[int, ...], tuple[int, ...] | None, int] | None = None
    where: torch.Tensor | None = None


def item_tables(
    lengths: Sequence[int],
    codes: Sequence[int],
    samples: Sequence[int] | None,
    dev: torch.device,
) -> list[Expected]:
    """Host-known items (one run each, token order) as per-code tables on ``dev``, cached."""
    key = (tuple(lengths), tuple(codes), None if samples is None else tuple(samples), dev)
    return kept(_ITEM_TABLES, 16, key, lambda: [_item_table(*key, c) for c in sorted(set(codes))])


_ITEM_TABLES: dict[tuple, list[Expected]] = {}


def _item_table(lengths, codes, samples, dev, code: int) -> Expected:
    idx = [i for i, k in enumerate(codes) if k == code]
    n = tuple(lengths[i] for i in idx)
    smp = None if samples is None else tuple(samples[i] for i in idx)
    return Expected(
        code,
        constant((1,) * len(n), dev),
        constant(n, dev),
        None if smp is None else constant(smp, dev),
        known=(n, smp, _host_hash(n, code)),
    )


def verify(
    lay: TokenLayout,
    expected: Sequence[Expected],
    features: torch.Tensor | None = None,
    extra: Sequence[torch.Tensor] = (),
) -> tuple[Verdict, list[int]]:
    """The verdict of every run of ``lay`` against ``expected`` and the device integers
    ``extra`` (0-d or 1-d, flattened), in one transfer. ``features``: ``[sum(n), h]`` to
    check for NaN/Inf."""
    dev = lay.device
    ids64 = lay.ids.reshape(-1).to(torch.int64)
    luts = None
    if len(expected) <= 1 and all(e.known is not None for e in expected):
        luts = verify_lut.tables(lay.grammar, lay.packed, lay.row_length, dev)
    runs = None  # a host int from the marker check (CPU), else read with the verdict
    if luts is not None:
        runs, parts, lay.ph = verify_lut.check(
            ids64.view(lay.batch, lay.row_length), luts, expected
        )
    else:
        parts = _table_parts(lay, expected, dev)
    probe = _finite_probe(features) if features is not None and features.numel() else None
    if probe is not None:
        parts.append(probe[0])
    w, w_sum = fingerprint_weights(ids64.numel(), dev)
    # + w_sum on the host: sum((ids + 1) * w), wrapping (CPU has an int64 dot; CUDA not)
    fp = torch.dot(ids64, w) if dev.type == "cpu" else (ids64 * w).sum()
    host_fp = w_sum
    for e in expected:
        if e.known is None:
            fp = fp + _table_hash(torch.stack([_owned_runs(e, dev), e.tokens.to(dev)], 1), e.code)
        else:
            host_fp += e.known[2]
    parts.append(fp)
    head = len(parts)
    # the one host sync of the aligned path: a handful of integers decide keep-all or diagnose
    vals = scalars_to_host(
        [*parts, *(x.to(torch.int64) for x in extra)], dev, why="aligned-path verdict"
    )
    vals, tail = vals[:head], vals[head:]
    if runs is not None:  # the scan's min and max decide the structure
        lo, hi, *rest = vals
        findings = int(lo < -1) + int(hi > 1)  # one per kind: below or above the sound range
        bad_runs = rest.pop(0) if expected and expected[0].known[0] else 0
    else:
        runs, findings, bad_runs, *rest = vals
    nonfinite = int(probe[1](rest.pop(0))) if probe is not None else 0
    fingerprint = (rest[0] + host_fp + 2**63) % 2**64 - 2**63  # int64 wraparound
    exact = probe is None or probe[2]
    return Verdict(runs, bad_runs, findings, nonfinite, fingerprint, exact), tail


def _owned_runs(e: Expected, dev) -> torch.Tensor:
    """Per item the runs it owns (none for a featureless item)."""
    return torch.where(e.tokens.to(dev, torch.int64) > 0, e.runs.to(dev, torch.int64), 0)


def _table_hash(table: torch.Tensor, code: int) -> torch.Tensor:
    """``sum(v * (j * _MIX_TABLE + code + 1))`` over the flat ``[n, 2]`` table (wrapping)."""
    w = torch.arange(table.numel(), device=table.device).view_as(table) * _MIX_TABLE + code + 1
    return (table * w).sum()


def _host_hash(lengths: tuple[int, ...], code: int) -> int:
    """:func:`_table_hash` of a host-known table (one run per item), on the host."""
    flat = (x for n in lengths for x in (int(n > 0), n))
    return sum(v * (j * _MIX_TABLE + code + 1) for j, v in enumerate(flat))


def _table_parts(lay: TokenLayout, expected: Sequence[Expected], dev) -> list[torch.Tensor]:
    """Device scalars ``[runs, structure violations, bad runs]`` (the module's docstring)."""
    start, end = lay.run_bounds()
    n_runs = torch.count_nonzero(start)
    findings = lay.structure_violations(start, end).to(torch.int64)
    bad = want_total = torch.zeros((), dtype=torch.int64, device=dev)
    one = len(lay.grammar.placeholders) == 1  # every run is of the one code
    for e in expected:
        if one:
            start_m, end_m, ph_m = start, end, lay.ph
        else:  # no breaks (they come with one modality): every token of a run has its code
            is_code = lay.code == e.code
            start_m, end_m, ph_m = start & is_code, end & is_code, lay.ph & is_code
        if e.where is not None:
            start_m, end_m, ph_m = start_m & e.where, end_m & e.where, ph_m & e.where
        size = e.tokens.to(dev, torch.int64)
        per_row = _owned_runs(e, dev)
        if per_row.numel() == 0:
            continue  # its runs are counted by the total below
        cum_runs = torch.cumsum(per_row, 0)
        want_total = want_total + cum_runs[-1]
        base = torch.cumsum(per_row * size, 0) - per_row * size
        run_idx = torch.cumsum(start_m.reshape(-1), 0) - 1
        ph_cum = torch.cumsum(ph_m.reshape(-1), 0)
        # read at the run ends only: on CPU at their positions (nonzero syncs with no device
        # there), which spares the per-token search and gathers; elsewhere at every token
        ends = end_m.reshape(-1)
        if dev.type == "cpu":
            at = torch.nonzero(ends).view(-1)
            run_idx, ph_cum, ends = run_idx[at], ph_cum[at], None
        row = torch.searchsorted(cum_runs, run_idx, right=True).clamp(max=per_row.numel() - 1)
        within = run_idx - (cum_runs[row] - per_row[row])
        want = base[row] + size[row] * (within + 1)
        off = (run_idx >= cum_runs[-1]) | (ph_cum != want)  # past the table, or miscounted
        bad = bad + torch.count_nonzero(off if ends is None else ends & off)
        bad = bad + (torch.count_nonzero(start_m) != cum_runs[-1]).long()
        if e.known is None:  # one run per item (the host's items) never spans two samples
            bad = bad + _items_across_samples(lay, start_m, per_row, cum_runs)
        if e.samples is not None:
            want_s = torch.zeros(lay.num_samples, dtype=torch.int64, device=dev)
            want_s.index_add_(0, e.samples.to(dev, torch.int64), per_row)
            bad = bad + torch.count_nonzero(lay.runs_per_sample(start_m) != want_s)
        if e.declared is not None:
            bad = bad + torch.count_nonzero(e.declared.to(dev, torch.int64) != per_row * size)
    bad = bad + (n_runs != want_total).long()  # runs of a modality no table covers
    return [n_runs, findings, bad]


def _items_across_samples(
    lay: TokenLayout, run_start: torch.Tensor, per_row: torch.Tensor, cum_runs: torch.Tensor
) -> torch.Tensor:
    """Device scalar: sample boundaries inside an item's runs (one video fed to two samples).
    Sample ``k`` starts after ``before[k]`` runs; item ``r`` holds runs
    ``[cum_runs[r] - per_row[r], cum_runs[r])``."""
    counts = lay.runs_per_sample(run_start)
    before = torch.cumsum(counts, 0) - counts
    row = torch.searchsorted(cum_runs, before, right=True)
    inside = row < cum_runs.numel()
    row = row.clamp(max=cum_runs.numel() - 1)
    return torch.count_nonzero(inside & (before > cum_runs[row] - per_row[row]))


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


_WEIGHTS: dict[tuple[int, torch.device], tuple[torch.Tensor, int]] = {}


def fingerprint_weights(n: int, dev: torch.device) -> tuple[torch.Tensor, int]:
    """The fingerprint's weights ``arange(n) * _MIX + 1`` (int64, wrapping) and their sum on
    the host (exact mod 2**64), cached."""
    return kept(
        _WEIGHTS,
        8,
        (n, dev),
        lambda: (torch.arange(n, device=dev) * _MIX + 1, _MIX * (n * (n - 1) // 2) + n),
    )


__all__ = ["Expected", "Verdict", "item_tables", "verify"]
