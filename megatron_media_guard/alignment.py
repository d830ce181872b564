"""Per-sample alignment of placeholder runs with media items (host side).

Runs come from :func:`runs.parse_runs`; items in feature-concatenation order. The
check is per sample and per run, so errors that cancel in batch totals (+k in one
sample, -k in another; two items of different lengths swapped) are caught.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from .items import MediaItem
from .runs import TRUNCATION_KINDS, Finding, ParsedRuns, Run


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
    """How one sample's runs compare with its items.

    expected: the placeholder run lengths found in its tokens, in order.
    got: its items' feature lengths, in order.
    items: the items' indices in the caller's order.
    first_mismatch: index (within the sample) of the first run that disagrees.
    """

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


def _key(length: int, modality: str) -> tuple[int, str]:
    return length, modality


def _assign_implicit(
    runs: Sequence[Run], items: Sequence[MediaItem]
) -> tuple[list[int | None], list[int]]:
    """Match runs to items in order from both ends; returns each item's sample (None: orphan).

    Without sample labels, a missing or extra item can sit anywhere its neighbours' keys
    (length, modality) allow. Runs are paired from the front up to the earliest place the
    break could be, and from the back down to the latest; the runs in between are
    ambiguous: their items are left unclaimed (orphans) and their samples come out short of
    items (count mismatch), never paired with a guess. With equal counts nothing shifts and
    item i stays with run i.
    """
    nr, ni = len(runs), len(items)
    rk = [_key(r.length, r.modality) for r in runs]
    ik = [_key(it.num_features, it.modality) for it in items]
    n = min(nr, ni)
    p = 0
    while p < n and rk[p] == ik[p]:
        p += 1
    q = 0
    while q < n and rk[nr - 1 - q] == ik[ni - 1 - q]:
        q += 1
    extra_runs = max(0, nr - ni)
    if nr == ni:  # both ends pair run i with item i: only a real mismatch is left between
        lo, hi = p, max(p, nr - q)
    else:  # the break can be anywhere in [nr - q - extra_runs, p]
        earliest = max(0, nr - q - extra_runs)
        lo, hi = min(p, earliest), min(nr, max(p, earliest) + extra_runs)
    owner: list[int | None] = [None] * ni
    for i in range(lo):
        owner[i] = runs[i].sample
    for j in range(nr - hi):
        owner[ni - 1 - j] = runs[nr - 1 - j].sample
    if nr == ni:  # no shift: item i belongs with run i, mismatched or not
        for i in range(lo, hi):
            owner[i] = runs[i].sample
    # otherwise the items between are orphans: which ambiguous run each belongs to is
    # unknown, so the samples of those runs come out short of items (count mismatch)
    orphans = [i for i in range(ni) if owner[i] is None]
    return owner, orphans


def align(
    parsed: ParsedRuns, items: Sequence[MediaItem], *, explicit: bool | None = None
) -> AlignmentReport:
    """Classify every sample of a parsed batch against its items."""
    items = tuple(items)
    if explicit is None:
        explicit = any(it.sample is not None for it in items)
    if explicit:
        owner: list[int | None] = [it.sample for it in items]
        orphans: list[int] = []
    else:
        owner, orphans = _assign_implicit(parsed.runs, items)
    runs_of: dict[int, list[Run]] = {}
    for r in parsed.runs:
        runs_of.setdefault(r.sample, []).append(r)
    items_of: dict[int, list[int]] = {}
    for i, smp in enumerate(owner):
        if smp is not None:
            items_of.setdefault(smp, []).append(i)
    finds_of: dict[int, list[Finding]] = {}
    stray: list[Finding] = []
    for f in parsed.findings:
        if f.sample is None:
            stray.append(f)
        else:
            finds_of.setdefault(f.sample, []).append(f)
    reports = tuple(
        _sample_report(
            smp,
            runs_of.get(smp, []),
            [(i, items[i]) for i in items_of.get(smp, [])],
            finds_of.get(smp, []),
            row=smp if not parsed.packed else 0,
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


def _sample_report(
    sample: int,
    runs: list[Run],
    items: list[tuple[int, MediaItem]],
    findings: list[Finding],
    row: int,
) -> SampleReport:
    expected = tuple(r.length for r in runs)
    got = tuple(it.num_features for _, it in items)
    rmods = tuple(r.modality for r in runs)
    imods = tuple(it.modality for _, it in items)
    first = next(
        (
            k
            for k, (a, b, ma, mb) in enumerate(zip(expected, got, rmods, imods))
            if a != b or ma != mb
        ),
        None,
    )
    if first is None and len(expected) != len(got):
        first = min(len(expected), len(got))
    truncs = [f for f in findings if f.kind in TRUNCATION_KINDS]
    structural = [f for f in findings if f.kind not in TRUNCATION_KINDS]
    ph, ft = sum(expected), sum(got)
    if structural:
        status = Status.MALFORMED
        reason = "; ".join(f.describe() for f in structural[:3])
    elif truncs:
        status = Status.TRUNCATED
        reason = "; ".join(f.describe() for f in truncs[:3])
    elif len(expected) != len(got):
        status = Status.COUNT_MISMATCH
        reason = f"{len(expected)} placeholder runs for {len(got)} items"
    elif ph < ft:
        status = Status.SURPLUS
        reason = f"{ft} features for {ph} placeholders (+{ft - ph})"
    elif ph > ft:
        status = Status.DEFICIT
        reason = f"{ph} placeholders for {ft} features (-{ph - ft})"
    elif rmods != imods:
        status = Status.MODALITY_MISMATCH
        reason = f"run modalities {list(rmods)} vs item modalities {list(imods)}"
    elif first is not None:
        status = Status.LENGTH_MISMATCH
        reason = f"run {first} holds {expected[first]} placeholders, its item {got[first]} features"
    else:
        status = Status.ALIGNED
        reason = ""
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
    """Parse ``input_ids`` ``[b, s]`` with ``grammar`` and classify every sample against ``items``."""
    from .runs import parse_runs

    return align(parse_runs(input_ids, grammar, cu_seqlens), items)
