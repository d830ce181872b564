"""Aggregation behind ``media-guard report``: per-file counters and the summary they fold into
(see :mod:`.report` for the guarantees). Never imports torch."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType

from .records import EVENTS, FILE_PREFIX, FILE_SUFFIX, cut_words, json_safe
from .report_lines import (
    LINE_BAD,
    LINE_OK,
    LINE_TORN,
    MAX_TEMPLATE_LINE,
    PROBE_LINES,
    LineTemplates,
    open_rank_file,
    parse_line,
    template_match,
)
from .report_summary import ReportSummary

FATAL_EVENT = "raise"
OFFENDING_EVENTS = frozenset({"repair", "drop", "raise"})
NONE_LABEL = "(none)"
OTHER_LABEL = "(other)"
TOP_CAPACITY = 10_000
LABEL_CAP = 1_000
COMBO_CAP = 200_000
PARALLEL_MIN_BYTES = 32 << 20
_LABEL_LEN = 120
_LABEL_SCAN = 1024  # a label depends only on this much of a string (memo keys stay small)
_SID_LEN = 200  # longer string sample ids are cut in the summary
_SID_INT = 1 << 63
_STEP_MAX, _STEP_MIN = 1 << 62, -(1 << 62)

_FILE_RE = re.compile(re.escape(FILE_PREFIX) + r"(\d+)" + re.escape(FILE_SUFFIX) + r"\Z")
_DIGITS = re.compile(r"\d+")


class _HeavyHitters:
    """Counts of hashable keys in at most ``2 * capacity`` entries (batched Misra-Gries).

    While fewer than ``2 * capacity`` distinct keys arrive the counts are exact. On
    overflow the (capacity+1)-th largest count c is subtracted from every entry and
    the non-positive ones dropped: each estimate then undercounts by at most the
    sum of those c (``error``), and any key seen more than n/(capacity+1) times stays.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counts: dict[object, int] = {}
        self.error = 0

    def add(self, key: object) -> None:
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        if len(counts) >= 2 * self.capacity:
            self._prune()

    def merge(self, other: _HeavyHitters) -> None:
        """Fold in another summary (Misra-Gries summaries are mergeable: errors add)."""
        counts = self.counts
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0) + v
        self.error += other.error
        if len(counts) >= 2 * self.capacity:
            self._prune()

    def _prune(self) -> None:
        cut = sorted(self.counts.values(), reverse=True)[self.capacity]
        self.error += cut
        self.counts = {k: v - cut for k, v in self.counts.items() if v > cut}

    def top(self, n: int) -> list[tuple[object, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], str(kv[0])))[:n]


def _label(value: object) -> str:
    """A short one-line string key for a field (None, numbers, garbage, long text): whitespace
    runs as one space, cut at a word boundary to at most ``_LABEL_LEN`` characters."""
    if value is None:
        return NONE_LABEL
    if isinstance(value, str):
        text = value[:_LABEL_SCAN]
    else:
        try:
            text = json.dumps(value, default=str)[:_LABEL_SCAN]
        except (ValueError, TypeError, RecursionError):  # huge ints, deep nesting
            text = f"<{type(value).__name__}>"
    return cut_words(" ".join(text.split()), _LABEL_LEN) or NONE_LABEL


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def _file_rank(path: Path) -> int | None:
    m = _FILE_RE.match(path.name)
    return int(m.group(1)) if m else None


class _Aggregator:
    """Streaming counters over records; one instance per report."""

    def __init__(self, ranks: Iterable[int] | None, steps: Iterable[int] | None) -> None:
        self.ranks = None if ranks is None else frozenset(ranks)
        self.steps = None if steps is None else frozenset(steps)
        self.combo: dict[tuple[int | None, str, str, str], int] = {}
        self.reasons: dict[str, str] = {}
        self.reason_classes: set[str] = set()
        self.top = _HeavyHitters(TOP_CAPACITY)
        self.lines = self.records = self.matched = self.malformed = self.other_schema = 0
        self.malformed_by_file: dict[str, int] = {}
        self.torn: list[str] = []
        self.skipped: dict[str, str] = {}
        self.templates = LineTemplates()
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.fatal: dict[str, object] | None = None
        self.fatal_key: tuple | None = None

    def _reason(self, value: object) -> str:
        """The class of a non-None reason (digits as ``#``), memoized per raw reason."""
        key = value[:_LABEL_SCAN] if isinstance(value, str) else _label(value)
        cls = self.reasons.get(key)
        if cls is None:
            cls = _DIGITS.sub("#", _label(key))
            if cls not in self.reason_classes:
                if len(self.reason_classes) >= LABEL_CAP:
                    cls = OTHER_LABEL
                else:
                    self.reason_classes.add(cls)
            if len(self.reasons) > 4 * LABEL_CAP:
                self.reasons.clear()
            self.reasons[key] = cls
        return cls

    def read(self, path: Path, file_index: int) -> None:
        """Stream one file into the counters (the hot loop: locals only). A file that is not
        a regular file, or cannot be opened or read, is listed in ``skipped`` with the reason."""
        name = str(path)
        f, why = open_rank_file(path)
        if f is None:
            self.skipped[name] = why or "cannot be opened"
            return
        file_rank = _file_rank(path)
        self.templates = LineTemplates()  # per file: a template holds the rank, files differ
        loads, top_add = json.loads, self.top.add
        combo, ranks, steps = self.combo, self.ranks, self.steps
        known, add_template, facts_of = self.templates.facts, self.templates.add, self._facts
        match, max_len = template_match, MAX_TEMPLATE_LINE  # report_lines.cut, inlined
        lines = records = matched = bad = other_schema = 0
        fast = True
        lo, hi = _STEP_MAX, _STEP_MIN
        last_bad = torn = False
        try:
            with f:
                for line in f:
                    lines += 1
                    if fast and lines == PROBE_LINES:
                        fast = self.templates.useful(lines)
                    m = match(line) if fast and len(line) <= max_len else None
                    key = None if m is None else (m.group(1), line[m.end() :])
                    facts = None if key is None else known.get(key)
                    rec = None
                    if facts is not None:
                        st = m.group(2)
                        step = None if st == "null" else int(st)
                    else:
                        status, rec = parse_line(line, loads)
                        if status is not LINE_OK:
                            if status is LINE_TORN:  # only the last line can lack its newline
                                torn = True
                                break
                            if status is LINE_BAD:
                                bad += 1
                                last_bad = True
                            else:
                                lines -= 1  # a blank line is neither record nor garbage
                            continue
                        facts = facts_of(rec)
                        step = rec.get("step")
                        if type(step) is not int:
                            step = None
                        if key is not None:
                            add_template(key, rec, facts)
                    last_bad = False
                    records += 1
                    rank, event, action, reason, sid, schema_1 = facts
                    if rank is None:
                        rank = file_rank
                    if ranks is not None and rank not in ranks:
                        continue
                    if steps is not None and step not in steps:
                        continue
                    matched += 1
                    if step is not None:
                        if step < lo:
                            lo = step
                        if step > hi:
                            hi = step
                    if not schema_1:
                        other_schema += 1
                    key = (rank, event, action, reason)
                    count = combo.get(key)
                    if count is None:
                        if len(combo) >= COMBO_CAP:
                            key = (rank, OTHER_LABEL, OTHER_LABEL, OTHER_LABEL)
                            count = combo.get(key, 0)
                        else:
                            count = 0
                    combo[key] = count + 1
                    if event in OFFENDING_EVENTS:
                        if sid is not None:
                            top_add(sid)
                        if event == FATAL_EVENT:
                            self._fatal(rec or loads(line), rank, step, file_index, lines, name)
        except (OSError, ValueError) as err:  # EIO mid-file, a file replaced under us
            self.skipped[name] = f"read failed after {lines} lines ({type(err).__name__}: {err})"
        if last_bad and not torn:  # invalid JSON at end of file: a torn write, not garbage
            bad -= 1
            torn = True
        if torn:
            self.torn.append(name)
        if bad:
            self.malformed_by_file[name] = bad
        self.lines += lines
        self.records += records
        self.matched += matched
        self.malformed += bad
        self.other_schema += other_schema
        self._steps(lo if lo != _STEP_MAX else None, hi if hi != _STEP_MIN else None)
        self.templates = LineTemplates()  # freed: a worker returns (pickles) its counters only

    def _facts(self, rec: dict) -> tuple:
        """(rank or None, event, action, reason class, sample id or None, schema is 1): what
        the counters need from a record, every string bounded."""
        get = rec.get
        rank, event, action, reason, sid = (
            get("rank"),
            get("event"),
            get("action"),
            get("reason"),
            get("sample_id"),
        )
        if type(rank) is not int:
            rank = None
        if type(event) is not str or len(event) > _LABEL_LEN:
            event = _label(event)
        if type(action) is not str or len(action) > _LABEL_LEN:
            action = _label(action)
        reason = NONE_LABEL if reason is None else self._reason(reason)
        if sid is not None and event in OFFENDING_EVENTS:
            if type(sid) is str:
                if len(sid) > _SID_LEN:
                    sid = sid[:_SID_LEN] + "..."
            elif type(sid) is not int or not -_SID_INT < sid < _SID_INT:
                sid = _label(sid)
        else:
            sid = None
        return rank, event, action, reason, sid, get("schema") == 1

    def merge(self, other: _Aggregator) -> None:
        """Fold in the counters of another aggregator (same filters; files read elsewhere)."""
        combo = self.combo
        for key, n in other.combo.items():
            if key not in combo and len(combo) >= COMBO_CAP:
                key = (key[0], OTHER_LABEL, OTHER_LABEL, OTHER_LABEL)
            combo[key] = combo.get(key, 0) + n
        self.top.merge(other.top)
        self.lines += other.lines
        self.records += other.records
        self.matched += other.matched
        self.malformed += other.malformed
        self.other_schema += other.other_schema
        self.malformed_by_file.update(other.malformed_by_file)
        self.torn.extend(other.torn)
        self.skipped.update(other.skipped)
        self._steps(other.first_step, other.last_step)
        if other.fatal_key is not None and (
            self.fatal_key is None or other.fatal_key < self.fatal_key
        ):
            self.fatal_key, self.fatal = other.fatal_key, other.fatal

    def _steps(self, lo: int | None, hi: int | None) -> None:
        if lo is not None and (self.first_step is None or lo < self.first_step):
            self.first_step = lo
        if hi is not None and (self.last_step is None or hi > self.last_step):
            self.last_step = hi

    def _fatal(self, rec: dict, rank, step, file_index: int, line_no: int, name: str) -> None:
        t = _parse_time(rec.get("time"))
        key = (
            t is None,
            t or datetime.min.replace(tzinfo=timezone.utc),
            rank is None,
            rank or 0,
            step is None,
            step or 0,
            file_index,
            line_no,
        )
        if self.fatal_key is None or key < self.fatal_key:
            self.fatal_key = key
            safe = json_safe(rec)  # bounded: strings, lists and nesting cut (hostile lines)
            if not isinstance(safe, dict):
                safe = {}
            self.fatal = {**safe, "rank": rank, "_file": name, "_line": line_no}

    def summary(self, files: list[Path], top: int) -> ReportSummary:
        by_rank: dict[int | None, dict[str, int]] = {}
        by_event: dict[str, int] = {}
        by_reason: dict[str, int] = {}
        by_action: dict[str, int] = {}
        for (rank, event, action, reason), n in self.combo.items():
            per = by_rank.setdefault(rank, {})
            per[event] = per.get(event, 0) + n
            by_event[event] = by_event.get(event, 0) + n
            if event == "consensus":  # every rank's echo of one raise: not more raises
                action = "(consensus)" if action == NONE_LABEL else f"{action} (consensus)"
            by_action[action] = by_action.get(action, 0) + n
            by_reason[reason] = by_reason.get(reason, 0) + n

        def ordered(d: dict[str, int]) -> Mapping[str, int]:
            return MappingProxyType(dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))))

        ranks_sorted = sorted(by_rank, key=lambda r: (r is None, r or 0))
        return ReportSummary(
            files=tuple(str(p) for p in files),
            lines=self.lines,
            records=self.records,
            matched=self.matched,
            malformed=self.malformed,
            malformed_by_file=MappingProxyType(dict(self.malformed_by_file)),
            torn_files=tuple(self.torn),
            skipped_files=MappingProxyType(dict(self.skipped)),
            other_schema=self.other_schema,
            by_rank=MappingProxyType(
                {r: MappingProxyType(_event_order(by_rank[r])) for r in ranks_sorted}
            ),
            by_event=MappingProxyType(_event_order(by_event)),
            by_reason=ordered(by_reason),
            by_action=ordered(by_action),
            top_sample_ids=tuple(self.top.top(top)),  # type: ignore[arg-type]
            sample_ids_exact=self.top.error == 0,
            first_step=self.first_step,
            last_step=self.last_step,
            first_fatal=None if self.fatal is None else MappingProxyType(self.fatal),
            ranks_filter=None if self.ranks is None else tuple(sorted(self.ranks)),
            steps_filter=None if self.steps is None else tuple(sorted(self.steps)),
        )


def _event_order(d: Mapping[str, int]) -> dict[str, int]:
    """Known events in schema order, then the others by name."""
    known = [e for e in EVENTS if e in d]
    return {e: d[e] for e in [*known, *sorted(k for k in d if k not in EVENTS)]}
