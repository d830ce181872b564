"""What a parse of token ids returns: runs, findings and their kinds (host-side records)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class FindingKind(enum.IntEnum):
    """Malformed structure found in token ids (codes are stable; names are public)."""

    NESTED_START = 1  # a start token inside an open region
    END_WITHOUT_START = 2  # an end token with no open region
    OUTSIDE_REGION = 3  # a placeholder (or break) outside any start/end region
    UNTERMINATED = 4  # a region or run not closed before the next text/marker
    CUT_BY_ROW_END = 5  # a region or run still open when the row ends
    CUT_BY_BOUNDARY = 6  # a region or run still open at a packed-sample boundary
    EMPTY_RUN = 7  # a run of break tokens holding no placeholder
    IN_PADDING = 8  # placeholder or marker after the last packed sample

    @property
    def label(self) -> str:
        return self.name.lower()


TRUNCATION_KINDS = frozenset({FindingKind.CUT_BY_ROW_END, FindingKind.CUT_BY_BOUNDARY})


@dataclass(frozen=True)
class Run:
    """One placeholder run. ``start``/``end`` are positions within ``row`` (end exclusive);
    ``length`` counts placeholder tokens (breaks excluded): the features it takes; modality
    ``"break"``: breaks only. key: :attr:`~.interleave.RunOrder.keys` at its first token (-1:
    none read)."""

    sample: int
    row: int
    start: int
    end: int
    length: int
    modality: str
    key: int = -1


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    sample: int | None
    row: int
    position: int

    def describe(self) -> str:
        where = "padding" if self.sample is None else f"sample {self.sample}"
        return f"{self.kind.label} at row {self.row} position {self.position} ({where})"

    def in_sample(self) -> str:
        """What :meth:`describe` says, less the sample and row its sample's record names."""
        return f"{self.kind.label} at position {self.position}"


@dataclass(frozen=True)
class ParsedRuns:
    """Host-side result of :func:`parse_runs`: runs in token order, findings, sample count."""

    runs: tuple[Run, ...]
    findings: tuple[Finding, ...]
    num_samples: int
    row_length: int
    packed: bool
    aliases: Mapping[str, str] = field(default_factory=dict)  # the grammar's (Grammar.aliases)
    collapsed: bool = False  # the grammar's: each run is one token standing for a whole item
