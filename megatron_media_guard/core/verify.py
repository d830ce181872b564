"""The aligned-path check: every run against per-modality count tables on the device, one
fixed-size verdict, one device-to-host transfer.

Each modality's items are a table on the device (:class:`Expected`): per item, in that
modality's token order, its runs and the placeholders of each, uploaded from the host (an
embed call's items, :func:`item_tables`) or computed there (grids, audio masks). Item ``r``
owns ``runs[r]`` consecutive runs of its modality (token order over the flattened batch),
the ``j``-th ending where the modality's placeholder count reaches the item's cumulative
size; the run counts must agree, a run no table covers is bad, and no item feeds two
samples. The order across modalities is never checked: the scatter is per modality too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import verify_lut
from .host import scalars_to_host
from .runs import TokenLayout

# multipliers of the fingerprint: the token ids', the tables' (odd 63-bit; wrap mod 2**64)
_MIX = 0x5851F42D4C957F2D
_MIX_TABLE = 0x2545F4914F6CDD1D


@dataclass(frozen=True)
class Verdict:
    """What the device found, as host integers.

    runs: placeholder runs found. bad_runs: runs that disagree with their expected item
    (length, modality, sample) or have none. findings: malformed positions.
    nonfinite: 1 when any feature is NaN/Inf (0 when not checked).
    fingerprint: a hash of the token ids and the tables, so ranks holding the same
    micro-batch can prove it.
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


@dataclass(frozen=True)
class Expected:
    """One modality's items as the device holds them (``[n]`` int64 each, on the ids' device).

    code: the modality's code in the grammar (a shared placeholder token's); runs / tokens:
    per item its runs and the placeholders of each; samples: per item its sample (explicit
    items: each sample then holds as many runs of the modality as its items own), else None;
    declared: per item the features the caller's items declare (must equal ``runs * tokens``),
    else None. where: per position of the flattened ids, where this table's runs may stand
    (a token two modalities share, told apart by a per-token type), else None: every
    position of ``code``. known: ``(lengths, samples, hash)`` where the host has them (one run per
    item), so the check may take the marker grammars' fast path; ``hash``: the table's part
    of the fingerprint (:func:`_table_hash`), summed on the host.
    """

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
    """Items the host knows (one run each, in token order; ``samples`` None: not checked) as
    per-code tables, uploaded to ``dev`` (kept for the last few: a training run repeats its
    items)."""
    key = (tuple(lengths), tuple(codes), None if samples is None else tuple(samples), dev)
    return _kept(_ITEM_TABLES, 16, key, lambda: _item_tables(*key))


_ITEM_TABLES: dict[tuple, list[Expected]] = {}


def _item_tables(lengths, codes, samples, dev) -> list[Expected]:
    by_code: dict[int, list[int]] = {}
    for i, c in enumerate(codes):
        by_code.setdefault(c, []).append(i)
    out = []
    for c, idx in sorted(by_code.items()):
        n = tuple(lengths[i] for i in idx)
        smp = None if samples is None else tuple(samples[i] for i in idx)
        out.append(
            Expected(
                c,
                _constant((1,) * len(n), dev),
                _constant(n, dev),
                None if smp is None else _constant(smp, dev),
                known=(n, smp, _host_hash(n, c)),
            )
        )
    return out


def verify(
    lay: TokenLayout,
    ids: torch.Tensor,
    expected: Sequence[Expected],
    features: torch.Tensor | None = None,
    extra: Sequence[torch.Tensor] = (),
) -> tuple[Verdict, list[int]]:
    """The verdict of every run against ``expected``, in one transfer, with the device
    integers ``extra`` (0-d or 1-d: the caller's own checks, the counts it must cut its
    items by) read in the same transfer, flattened. ``features``:
    ``[sum(n), h]`` to check for NaN/Inf, or None to skip that read. The verdict's
    ``bad_runs`` counts every disagreement (its ``runs`` is what the ids hold)."""
    dev = ids.device
    ids64 = ids.reshape(-1).to(torch.int64)
    luts = None
    if len(expected) <= 1 and all(e.known is not None for e in expected):
        luts = verify_lut.tables(lay.grammar, lay.packed, lay.row_length, dev)
    runs = None  # a host int from the marker check (CPU), else read with the verdict
    if luts is not None:
        lengths, samples, _ = expected[0].known if expected else ((), None, 0)
        runs, parts, lay.ph = verify_lut.check(
            ids64.view(lay.batch, lay.row_length),
            luts,
            _want_keys(lengths, expected[0].code if expected else 0, samples, lay, dev),
            len(lengths),
            samples is not None,
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
        findings = verify_lut.findings(lo, hi)
        bad_runs = rest.pop(0) if expected and expected[0].known[0] else 0
    else:
        runs, findings, bad_runs, *rest = vals
    nonfinite = int(probe[1](rest.pop(0))) if probe is not None else 0
    fingerprint = (rest[0] + host_fp + 2**63) % 2**64 - 2**63  # int64 wraparound
    exact = probe is None or probe[2]
    return Verdict(runs, bad_runs, findings, nonfinite, fingerprint, exact), tail


def _owned_runs(e: Expected, dev) -> torch.Tensor:
    """Per item the runs it owns: none where it has no placeholder (a featureless item)."""
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
    """Device scalars ``[runs, structure violations, bad runs]``: every run against its
    modality's table (see the module's docstring)."""
    start, end = lay.run_bounds()
    n_runs = torch.count_nonzero(start)
    findings = lay.structure_violations(start, end).to(torch.int64)
    bad = want_total = torch.zeros((), dtype=torch.int64, device=dev)
    one = len(lay.grammar.placeholders) == 1  # every run is of the one code
    if expected and not one:
        code_start, code_end = _run_codes(lay, start)
    for e in expected:
        if one:
            start_m, end_m, ph_m = start, end, lay.ph
        else:
            start_m, end_m = start & (code_start == e.code), end & (code_end == e.code)
            ph_m = lay.ph & (lay.code == e.code)
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
        row = torch.searchsorted(cum_runs, run_idx, right=True).clamp(max=per_row.numel() - 1)
        within = run_idx - (cum_runs[row] - per_row[row])
        want = base[row] + size[row] * (within + 1)
        late = run_idx >= cum_runs[-1]
        bad = bad + torch.count_nonzero(end_m.reshape(-1) & (late | (ph_cum != want)))
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


def _run_codes(lay: TokenLayout, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(code at each run's start, code at each run's end)``, ``[b, s]``: the token's own
    code; where a run may open or close with a break, its first / last placeholder's."""
    if not lay.grammar.break_ids:
        return lay.code, lay.code
    n = lay.ph.numel()
    pos = torch.arange(n, device=lay.device)
    last = torch.cummax(torch.where(lay.ph.reshape(-1), pos, -1), 0).values.clamp(min=0)
    return lay.run_codes(start), lay.code.reshape(-1)[last].view_as(lay.code)


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


def _want_keys(lengths, code: int, samples, lay: TokenLayout, dev) -> torch.Tensor | None:
    """Item r's key for :func:`verify_lut.check` (modality + 1, length, sample), cached."""
    if not lengths:
        return None
    s = lay.row_length
    row = 8 * (s + 2)
    smp = samples if samples is not None else [0] * len(lengths)
    # a length past the row is capped at s + 1, which no run has: uncapped, 8 * n could
    # reach into the next row's keys (n = s + 3 in sample 0 reads as 1 in sample 1)
    keys = tuple([code + 1 + 8 * min(n, s + 1) + row * r for n, r in zip(lengths, smp)])
    return _constant(keys, dev)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(values: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``dev``, kept for the last few (a run repeats its items)."""
    return _kept(
        _CONSTANTS,
        32,
        (values, dev),
        lambda: torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True),
    )


_WEIGHTS: dict[tuple[int, torch.device], tuple[torch.Tensor, int]] = {}


def fingerprint_weights(n: int, dev: torch.device) -> tuple[torch.Tensor, int]:
    """``arange(n) * _MIX + 1`` (int64, wrapping), the fingerprint's per-position weights, and
    their sum as a host int; kept for the last few (size, device) pairs (a training run
    repeats its shapes)."""
    # sum(w) on the host, exact mod 2**64
    return _kept(
        _WEIGHTS,
        8,
        (n, dev),
        lambda: (torch.arange(n, device=dev) * _MIX + 1, _MIX * (n * (n - 1) // 2) + n),
    )


def _kept(store: dict, limit: int, key, make):
    """``store[key]``, made by ``make()`` on a miss; the oldest entry goes past ``limit``."""
    got = store.get(key)
    if got is None:
        if len(store) >= limit:
            store.pop(next(iter(store)))
        got = store[key] = make()
    return got


__all__ = ["Expected", "Verdict", "item_tables", "verify"]
