"""Per-sample alignment of placeholder runs with media items (host side): per sample and
per run, so errors that cancel in batch totals (+k here, -k there; two items swapped) are
caught. Under a collapsed grammar (megatron-core LLaVA) a run stands for its whole item:
only the runs per sample are counted."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .items import MediaItem, metadata_batch
from .parsed import TRUNCATION_KINDS, Finding, ParsedRuns, Run
from .runs import TokenLayout, parse_layout


class Status(str, enum.Enum):
    """Classification of a sample, in order of precedence."""

    ALIGNED = "aligned"
    MALFORMED = "malformed"  # structural finding: nested/unterminated region, stray placeholder
    TRUNCATED = "truncated"  # a run cut by the row end or a packed-sample boundary
    COUNT_MISMATCH = "count_mismatch"  # number of runs != number of items
    SURPLUS = "surplus"  # more features than placeholders (e.g. the engine shrank the media)
    DEFICIT = "deficit"  # more placeholders than features (e.g. an extra pad token)
    MODALITY_MISMATCH = "modality_mismatch"  # a run's modality differs from its item's
    LENGTH_MISMATCH = "length_mismatch"  # equal totals, a run's length differs (swapped items)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SampleReport:
    """One sample's runs against its items: run lengths (``expected``), item lengths
    (``got``), the items' indices, the first run (within the sample) that disagrees."""

    sample: int
    sample_id: str | int | None
    row: int
    status: Status
    expected: tuple[int, ...]
    got: tuple[int, ...]
    items: tuple[int, ...]
    run_modalities: tuple[str, ...]
    item_modalities: tuple[str, ...]
    first_mismatch: int | None
    findings: tuple[Finding, ...]
    runs: tuple[Run, ...]
    reason: str

    @property
    def ok(self) -> bool:
        return self.status is Status.ALIGNED

    @property
    def placeholders(self) -> int:
        return sum(self.expected)

    @property
    def features(self) -> int:
        return sum(self.got)


@dataclass(frozen=True)
class AlignmentReport:
    """Every sample's report, plus items that no sample could claim (``orphans``)."""

    samples: tuple[SampleReport, ...]
    orphans: tuple[int, ...]
    stray_findings: tuple[Finding, ...]  # findings outside any sample (packed padding)
    num_runs: int
    num_items: int
    total_placeholders: int
    total_features: int

    @property
    def ok(self) -> bool:
        return not self.orphans and not self.stray_findings and all(s.ok for s in self.samples)

    @property
    def mismatched(self) -> tuple[SampleReport, ...]:
        return tuple(s for s in self.samples if not s.ok)


def _forced(small: Sequence[tuple], big: Sequence[tuple]) -> list[int] | None:
    """Per element of ``small``, the index in ``big`` every order-keeping matching of equal
    keys gives it (-1: several fit; None: no matching). Every matching lies between the
    leftmost and the rightmost greedy one."""
    left: list[int] = []
    j = 0
    for k in small:
        while j < len(big) and big[j] != k:
            j += 1
        if j == len(big):
            return None
        left.append(j)
        j += 1
    right = [0] * len(small)
    j = len(big) - 1
    for s in range(len(small) - 1, -1, -1):
        while big[j] != small[s]:
            j -= 1
        right[s] = j
        j -= 1
    return [lo if lo == hi else -1 for lo, hi in zip(left, right)]


def _assign_implicit(
    runs: Sequence[Run], items: Sequence[MediaItem], collapsed: bool = False
) -> tuple[list[int | None], list[int]]:
    """Each item's sample (None: unclaimed) and the unclaimed items with features (orphans),
    for items without a sample. As many runs as items: item i takes run i. Otherwise an
    item takes only the run every order-keeping (length, modality) matching gives it: no
    sample is ever fed a guessed item (it comes out short: a count mismatch)."""
    real = [i for i, it in enumerate(items) if it.num_features > 0]
    rk = [(0 if collapsed else r.length, r.modality) for r in runs]
    ik = [(0 if collapsed else items[i].num_features, items[i].modality) for i in real]
    if len(rk) == len(ik):  # (run, item) pairs
        pairs = [(k, k) for k in range(len(rk))]
    elif len(rk) < len(ik):  # extra items: place the runs among them
        pairs = list(enumerate(_forced(rk, ik) or []))
    else:  # extra runs: place the items among them
        pairs = [(r, j) for j, r in enumerate(_forced(ik, rk) or [])]
    owner: list[int | None] = [None] * len(items)
    for r, j in pairs:
        if r >= 0 and j >= 0:  # -1: several fit
            owner[real[j]] = runs[r].sample
    return owner, [i for i in real if owner[i] is None]


def align(parsed: ParsedRuns, items: Sequence[MediaItem]) -> AlignmentReport:
    """Classify every sample of a parsed batch against its items (every item names its
    sample, or none does)."""
    items = tuple(items)
    if parsed.aliases:  # aliased modalities match runs of their token's modality
        items = tuple(
            replace(it, modality=parsed.aliases[it.modality])
            if it.modality in parsed.aliases
            else it
            for it in items
        )
    if any(it.sample is not None for it in items):  # items without features own no run
        owner: list[int | None] = [it.sample if it.num_features else None for it in items]
        orphans: list[int] = []
    else:
        owner, orphans = _assign_implicit(parsed.runs, items, parsed.collapsed)
    runs_of = by_key((r.sample, r) for r in parsed.runs)
    items_of = by_key((smp, i) for i, smp in enumerate(owner))  # None: unclaimed
    finds_of = by_key((f.sample, f) for f in parsed.findings)
    stray = finds_of.pop(None, [])  # findings outside any sample (packed padding)
    reports = tuple(
        _sample_report(
            smp,
            runs_of.get(smp, []),
            [(i, items[i]) for i in items_of.get(smp, [])],
            finds_of.get(smp, []),
            row=smp if not parsed.packed else 0,
            collapsed=parsed.collapsed,
        )
        for smp in range(parsed.num_samples)
    )
    return AlignmentReport(
        samples=reports,
        orphans=tuple(orphans),
        stray_findings=tuple(stray),
        num_runs=len(parsed.runs),
        num_items=len(items),
        total_placeholders=sum(r.length for r in parsed.runs),
        total_features=sum(it.num_features for it in items),
    )


def by_key(pairs) -> dict:
    """``key -> [values]`` from ``(key, value)`` pairs, each list in their order."""
    out: dict = {}
    for smp, v in pairs:
        out.setdefault(smp, []).append(v)
    return out


def _sample_report(
    sample: int,
    runs: list[Run],
    items: list[tuple[int, MediaItem]],
    findings: list[Finding],
    row: int,
    collapsed: bool = False,
) -> SampleReport:
    got = tuple(it.num_features for _, it in items)
    if collapsed:  # one token per item, expanded by the model: a run is as long as its item
        expected = tuple(g for g, _ in zip(got, runs)) + tuple(1 for _ in runs[len(got) :])
    else:
        expected = tuple(r.length for r in runs)
    rmods = tuple(r.modality for r in runs)
    imods = tuple(it.modality for _, it in items)
    pairs = zip(zip(expected, rmods), zip(got, imods))  # (length, modality): run vs item
    first = next((k for k, (run, item) in enumerate(pairs) if run != item), None)
    if first is None and len(expected) != len(got):
        first = min(len(expected), len(got))
    truncs = [f for f in findings if f.kind in TRUNCATION_KINDS]
    structural = [f for f in findings if f.kind not in TRUNCATION_KINDS]
    ph, ft = sum(expected), sum(got)
    if structural:
        status, reason = Status.MALFORMED, "; ".join(f.in_sample() for f in structural[:3])
    elif truncs:
        status, reason = Status.TRUNCATED, "; ".join(f.in_sample() for f in truncs[:3])
    elif len(expected) != len(got):
        status = Status.COUNT_MISMATCH
        reason = f"{len(expected)} placeholder runs for {len(got)} items"
    elif ph < ft:
        status, reason = Status.SURPLUS, f"{ft} features for {ph} placeholders (+{ft - ph})"
    elif ph > ft:
        status, reason = Status.DEFICIT, f"{ph} placeholders for {ft} features (-{ph - ft})"
    elif rmods != imods:
        status = Status.MODALITY_MISMATCH
        reason = f"run modalities {list(rmods)} vs item modalities {list(imods)}"
    elif first is not None:
        status = Status.LENGTH_MISMATCH
        reason = f"run {first} holds {expected[first]} placeholders, its item {got[first]} features"
    else:
        status, reason = Status.ALIGNED, ""
    sample_id = next((it.sample_id for _, it in items if it.sample_id is not None), None)
    row_of = runs[0].row if runs else row
    return SampleReport(
        sample=sample,
        sample_id=sample_id,
        row=row_of,
        status=status,
        expected=expected,
        got=got,
        items=tuple(i for i, _ in items),
        run_modalities=rmods,
        item_modalities=imods,
        first_mismatch=first if status is not Status.ALIGNED else None,
        findings=tuple(findings),
        runs=tuple(runs),
        reason=reason,
    )


def check_alignment(
    input_ids, items: Sequence[MediaItem], grammar, cu_seqlens=None
) -> AlignmentReport:
    """The guard's check of a batch, without merging (``MediaGuard.check``, ``media-guard
    replay``, a bundle saved without a report): the ids parsed, the items checked as the merge
    checks them, every sample classified by :func:`align`. Raises :class:`MediaInputError`
    for ids, offsets or items no merge would take."""
    lay = TokenLayout(input_ids, grammar, cu_seqlens)
    return align(parse_layout(lay), metadata_batch(items, lay.num_samples).items)
