"""Aggregation behind ``media-guard report``: per-file counters and the summary they fold into
(see :mod:`.report` for the guarantees). Never imports torch."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType

from .records import EVENTS, FILE_PREFIX, FILE_SUFFIX, cut_words, json_safe, summary_line
from .report_grid import (
    NONE_LABEL,
    OTHER_LABEL,
    _family,
    _Grid,
    _HeavyHitters,
    _label,
    _size,
    _small,
    _Steps,
)
from .report_lines import (
    LINE_BLANK,
    LINE_OK,
    LINE_TORN,
    MAX_TEMPLATE_LINE,
    PROBE_LINES,
    LineTemplates,
    open_rank_file,
    parse_line,
    template_match,
)
from .report_summary import GridCounts, ReportSummary

FATAL_EVENT = "raise"
OFFENDING_EVENTS = frozenset({"repair", "drop", "raise"})
HEAT_EVENTS = ("drop", "repair", "raise", "budget")  # the page's heatmap, in this order
TOP_CAPACITY = 10_000
LABEL_CAP = 1_000
COMBO_CAP = 200_000
HEAT_CAP = 65_536  # (rank, step, event) bins kept for the heatmap; then the bins grow
SERIES_CAP = 16_384  # step bins of the records-over-steps chart
PARALLEL_MIN_BYTES = 32 << 20
_LABEL_LEN = 120
_REASON_LEN = 4096  # the writer's longest string: a reason it wrote is never cut
_EXAMPLE_LEN = 600  # an example record's summary line
_SID_LEN = 200  # longer string sample ids are cut in the summary
_SID_INT = 1 << 63
_STEP_MAX, _STEP_MIN = 1 << 62, -(1 << 62)

_HEAT = frozenset(HEAT_EVENTS)
_NO_KIND = (NONE_LABEL, NONE_LABEL)
_ITEM_KEYS = ("event", "modality", "item", "frames", "size", "fidelity", "family")

_FILE_RE = re.compile(re.escape(FILE_PREFIX) + r"(\d+)" + re.escape(FILE_SUFFIX) + r"\Z")
_DIGITS = re.compile(r"\d+")


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
        # (rank, event, action, reason class, (modality, family)) -> count
        self.combo: dict[tuple, int] = {}
        self.reasons: dict[str, str] = {}
        self.reason_classes: set[str] = set()
        # reason class -> (file index, line, rank, step, summary line); (none) has none
        self.reason_examples: dict[str, tuple | None] = {NONE_LABEL: None}
        self.top = _HeavyHitters(TOP_CAPACITY)
        self.heat = _Grid(HEAT_CAP, max_labels=len(HEAT_EVENTS) + 1)
        self.series = _Steps(SERIES_CAP)
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
        """The class of a non-None reason (digits as ``#``, full text up to the writer's
        longest string), memoized per raw reason."""
        key = value[: 2 * _REASON_LEN + 16] if isinstance(value, str) else _label(value)
        cls = self.reasons.get(key)
        if cls is None:
            cls = _DIGITS.sub("#", _label(key, _REASON_LEN))
            if cls not in self.reason_classes:
                if len(self.reason_classes) >= LABEL_CAP:
                    cls = OTHER_LABEL
                else:
                    self.reason_classes.add(cls)
            if len(self.reasons) > 2 * LABEL_CAP:
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
        loads, top_add, heat_add = json.loads, self.top.add, self.heat.add
        combo, ranks, steps = self.combo, self.ranks, self.steps
        filtered = ranks is not None or steps is not None
        per_step, examples = self.series, self.reason_examples
        series, s_shift, s_cap = per_step.counts, per_step.shift, per_step.cap
        known, add_template, facts_of = self.templates.facts, self.templates.add, self._facts
        match, max_len = template_match, MAX_TEMPLATE_LINE
        lines = records = matched = bad = other_schema = 0
        fast = True
        lo, hi = _STEP_MAX, _STEP_MIN
        torn = False
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
                            if status is LINE_TORN and records:  # cut after valid records
                                torn = True
                                break
                            if status is LINE_BLANK:
                                lines -= 1  # a blank line is neither record nor garbage
                            else:
                                bad += 1
                            continue
                        facts = facts_of(rec)
                        step = rec.get("step")
                        if type(step) is not int:
                            step = None
                        if key is not None:
                            add_template(key, rec, facts)
                    records += 1
                    rank, event, action, reason, sid, schema_1, kind, item = facts
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
                        sb = step >> s_shift
                        count = series.get(sb)
                        if count is None:
                            if len(series) >= s_cap:
                                per_step.coarsen()
                                series, s_shift = per_step.counts, per_step.shift
                                sb = step >> s_shift
                                count = series.get(sb, 0)
                            else:
                                count = 0
                        series[sb] = count + 1
                    if not schema_1:
                        other_schema += 1
                    key = (rank, event, action, reason, kind)
                    count = combo.get(key)
                    if count is None:
                        if len(combo) >= COMBO_CAP:
                            key = (rank, OTHER_LABEL, OTHER_LABEL, OTHER_LABEL, _NO_KIND)
                            count = combo.get(key, 0)
                        else:
                            count = 0
                    combo[key] = count + 1
                    # a class is first seen in a full parse unless a filter skipped that line
                    if (rec is not None or filtered) and reason not in examples:
                        self._example(rec or loads(line), reason, rank, step, file_index, lines)
                    if event in _HEAT:
                        heat_add(rank, step, event)
                        if sid is not None:
                            top_add(sid, (file_index, lines, rank, step, event, *item))
                        if event == FATAL_EVENT:
                            self._fatal(rec or loads(line), rank, step, file_index, lines, name)
        except (OSError, ValueError) as err:  # EIO mid-file, a file replaced under us
            self.skipped[name] = f"read failed after {lines} lines ({type(err).__name__}: {err})"
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
        """What the counters need from a record, every string bounded: (rank or None, event,
        action, reason class, sample id or None, schema is 1, (modality, family), the item
        (modality, item, frames, size, fidelity, family))."""
        get = rec.get
        rank, event, action, reason, sid = map(
            get, ("rank", "event", "action", "reason", "sample_id")
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
        modality, family = _label(get("modality"), 40), _label(_family(rec), 40)
        hw, extra = get("frame_hw"), get("extra")
        if hw is None and isinstance(extra, dict):
            hw = extra.get("size_hw")  # a repair's engine-sized image
        item = (
            None if modality == NONE_LABEL else modality,
            _small(get("item")),
            _small(get("num_frames")),
            _size(hw),
            None if get("fidelity") is None else _label(get("fidelity"), 40),
            None if family == NONE_LABEL else family,
        )
        return (rank, event, action, reason, sid, get("schema") == 1, (modality, family), item)

    def _example(self, rec: dict, reason: str, rank, step, file_index: int, line: int) -> None:
        text = cut_words(summary_line(rec), _EXAMPLE_LEN)
        self.reason_examples[reason] = (file_index, line, rank, step, text)

    def merge(self, other: _Aggregator) -> None:
        """Fold in the counters of another aggregator (same filters; files read elsewhere)."""
        combo = self.combo
        for key, n in other.combo.items():
            if key not in combo and len(combo) >= COMBO_CAP:
                key = (key[0], OTHER_LABEL, OTHER_LABEL, OTHER_LABEL, _NO_KIND)
            combo[key] = combo.get(key, 0) + n
        for reason, ex in other.reason_examples.items():
            mine = self.reason_examples.get(reason)
            if ex is not None and (mine is None or ex[:2] < mine[:2]):
                self.reason_examples[reason] = ex
        self.top.merge(other.top)
        self.heat.merge(other.heat)
        self.series.merge(other.series)
        for name in ("lines", "records", "matched", "malformed", "other_schema"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
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
        by_kind: dict[tuple[str, str, str], int] = {}
        for (rank, event, action, reason, kind), n in self.combo.items():
            per = by_rank.setdefault(rank, {})
            per[event] = per.get(event, 0) + n
            by_event[event] = by_event.get(event, 0) + n
            action = _charted(event, action)
            by_action[action] = by_action.get(action, 0) + n
            by_reason[reason] = by_reason.get(reason, 0) + n
            k = (*kind, event)
            by_kind[k] = by_kind.get(k, 0) + n

        def ordered(d: dict[str, int]) -> Mapping[str, int]:
            return MappingProxyType(dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))))

        def where(file_index: int, line: int, rank, step) -> dict[str, object]:
            return {"rank": rank, "step": step, "file": str(files[file_index]), "line": line}

        reason_examples = {
            r: MappingProxyType({**where(*ex[:4]), "text": ex[4]})
            for r, ex in self.reason_examples.items()
            if ex is not None and r in by_reason
        }
        top_ids = self.top.top(top)
        sample_examples = {}
        for sid, _ in top_ids:
            ex = self.top.examples.get(sid)
            if ex is not None:
                sample_examples[sid] = MappingProxyType(
                    {**where(*ex[:4]), **dict(zip(_ITEM_KEYS, ex[4:]))}
                )
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
            top_sample_ids=tuple(top_ids),  # type: ignore[arg-type]
            sample_ids_exact=self.top.error == 0,
            first_step=self.first_step,
            last_step=self.last_step,
            first_fatal=None if self.fatal is None else MappingProxyType(self.fatal),
            ranks_filter=None if self.ranks is None else tuple(sorted(self.ranks)),
            steps_filter=None if self.steps is None else tuple(sorted(self.steps)),
            heat=_grid(self.heat),
            series=_per_step(self.series),
            by_kind=MappingProxyType(dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))),
            reason_examples=MappingProxyType(reason_examples),
            sample_examples=MappingProxyType(sample_examples),
        )


def _grid(grid: _Grid) -> GridCounts:
    return GridCounts(1 << grid.rank_shift, 1 << grid.step_shift, MappingProxyType(grid.cells()))


def _per_step(steps: _Steps) -> GridCounts:
    shift = steps.shift
    cells = {(None, b << shift, "records"): n for b, n in sorted(steps.counts.items())}
    return GridCounts(1, 1 << shift, MappingProxyType(cells))


def _charted(event: str, action: str) -> str:
    """The action as counted in ``by_action``: a consensus record is every rank's echo of a
    stage-wide round, not an action of its own."""
    if event == "consensus":
        return "(consensus)" if action == NONE_LABEL else f"{action} (consensus)"
    return action


def _event_order(d: Mapping[str, int]) -> dict[str, int]:
    """Known events in schema order, then the others by name."""
    known = [e for e in EVENTS if e in d]
    return {e: d[e] for e in [*known, *sorted(k for k in d if k not in EVENTS)]}
