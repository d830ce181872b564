"""The reader behind ``media-guard report DIR``: finds every rank's file, streams each line into
bounded counters (in worker processes for large runs) and folds them into a
:class:`ReportSummary`; :mod:`.report_format` renders it as text, :mod:`.report_html` as a page.

Its bounds (``COMBO_CAP``, ``LABEL_CAP``, ``TOP_CAPACITY``): docs/DIAGNOSTICS.md, "Memory and
speed".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import stat
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone
from os import PathLike
from pathlib import Path
from types import MappingProxyType

from ..errors import MediaInputError
from .records import EVENTS, FILE_PREFIX, FILE_SUFFIX, cut_words, json_safe, summary_line
from .report_grid import (
    NONE_LABEL,
    OTHER_LABEL,
    GridCounts,
    ReportSummary,
    _Grid,
    _HeavyHitters,
    _label,
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
    record_facts,
    template_match,
)

FATAL_EVENT = "raise"
HEAT_EVENTS = ("drop", "repair", "raise", "budget")  # the page's heatmap, in this order
TOP_CAPACITY = 10_000
LABEL_CAP = 1_000
COMBO_CAP = 200_000
HEAT_CAP = 65_536  # (rank, step, event) bins kept for the heatmap; then the bins grow
SERIES_CAP = 16_384  # step bins of the records-over-steps chart
PARALLEL_MIN_BYTES = 32 << 20
_REASON_LEN = 4096  # the writer's longest string: a reason it wrote is never cut
_EXAMPLE_LEN = 600  # an example record's summary line
_STEP_MAX, _STEP_MIN = 1 << 62, -(1 << 62)
_NO_TIME = datetime.min.replace(tzinfo=timezone.utc)

_HEAT = frozenset(HEAT_EVENTS)
_NO_KIND = (NONE_LABEL, NONE_LABEL)
_ITEM_KEYS = ("event", "modality", "item", "frames", "size", "fidelity", "family")
_FILE_RE = re.compile(re.escape(FILE_PREFIX) + r"(\d+)" + re.escape(FILE_SUFFIX) + r"\Z")
_DIGITS = re.compile(r"\d+")


# -- the counters ----------------------------------------------------------------------------
def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


class _Aggregator:
    """Streaming counters over records; one instance per report (and per worker process)."""

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
        self.series = _Grid(SERIES_CAP, max_labels=1)  # (None, step, "records")
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
        named = _FILE_RE.match(path.name)
        file_rank = int(named.group(1)) if named else None
        self.templates = LineTemplates()  # per file: a template holds the rank, files differ
        loads, top_add, heat_add = json.loads, self.top.add, self.heat.add
        combo, ranks, steps = self.combo, self.ranks, self.steps
        filtered = ranks is not None or steps is not None
        examples, series = self.reason_examples, self.series
        s_counts, s_shift = series.counts, series.step_shift  # the hot path of series.add
        known, add_template = self.templates.facts, self.templates.add
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
                        facts = record_facts(rec, self._reason)
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
                        bin_ = (None, step >> s_shift, "records")
                        count = s_counts.get(bin_)
                        if count is None:
                            bin_, count = series.room(None, step, "records")
                            s_counts, s_shift = series.counts, series.step_shift
                        s_counts[bin_] = count + 1
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
                        text = cut_words(summary_line(rec or loads(line)), _EXAMPLE_LEN)
                        examples[reason] = (file_index, lines, rank, step, text)
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
        t = _parse_time(rec.get("time"))  # the earliest time, then rank, step, file, line
        when = (t is None, t or _NO_TIME)
        key = (*when, rank is None, rank or 0, step is None, step or 0, file_index, line_no)
        if self.fatal_key is None or key < self.fatal_key:
            self.fatal_key = key
            safe = json_safe(rec)  # bounded: strings, lists and nesting cut (hostile lines)
            if not isinstance(safe, dict):
                safe = {}
            self.fatal = {**safe, "rank": rank, "_file": name, "_line": line_no}

    def summary(self, files: list[Path], top: int) -> ReportSummary:
        by_rank: defaultdict[int | None, Counter[str]] = defaultdict(Counter)
        by_event, by_reason, by_action = Counter[str](), Counter[str](), Counter[str]()
        by_kind: Counter[tuple[str, str, str]] = Counter()
        for (rank, event, action, reason, kind), n in self.combo.items():
            by_rank[rank][event] += n
            by_event[event] += n
            by_action[_charted(event, action)] += n
            by_reason[reason] += n
            by_kind[(*kind, event)] += n

        def ordered(d: Mapping[str, int]) -> Mapping[str, int]:
            return MappingProxyType(dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))))

        def where(file_index: int, line: int, rank, step) -> dict[str, object]:
            return {"rank": rank, "step": step, "file": str(files[file_index]), "line": line}

        reason_examples = {
            r: MappingProxyType({**where(*ex[:4]), "text": ex[4]})
            for r, ex in self.reason_examples.items()
            if ex is not None and r in by_reason
        }
        top_ids = self.top.top(top)
        sample_examples = {
            sid: MappingProxyType({**where(*ex[:4]), **dict(zip(_ITEM_KEYS, ex[4:]))})
            for sid, _ in top_ids
            if (ex := self.top.examples.get(sid)) is not None
        }
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
            series=_grid(self.series),
            by_kind=MappingProxyType(dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))),
            reason_examples=MappingProxyType(reason_examples),
            sample_examples=MappingProxyType(sample_examples),
        )


def _grid(grid: _Grid) -> GridCounts:
    return GridCounts(1 << grid.rank_shift, 1 << grid.step_shift, MappingProxyType(grid.cells()))


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


# -- the files -------------------------------------------------------------------------------
def find_files(paths_or_dir: str | PathLike[str] | Iterable[str | PathLike[str]]) -> list[Path]:
    """The diagnostics files named: a directory's ``media_guard.rank*.jsonl`` (sorted; when it
    holds none directly, those in its subdirectories, e.g. one per smoke run), or files."""
    items = [paths_or_dir] if isinstance(paths_or_dir, (str, PathLike)) else list(paths_or_dir)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            pattern = f"{FILE_PREFIX}*{FILE_SUFFIX}"
            out.extend(sorted(p.glob(pattern)) or sorted(p.rglob(pattern)))
        elif p.exists() or p.is_symlink():  # a special file is reported as skipped, not here
            out.append(p)
        else:
            raise MediaInputError(
                f"no such diagnostics directory or file: {str(p)!r}", context={"path": str(p)}
            )
    return out


def _read_one(task: tuple[Path, int, frozenset[int] | None, frozenset[int] | None]) -> _Aggregator:
    path, index, ranks, steps = task
    agg = _Aggregator(ranks, steps)
    agg.read(path, index)
    return agg


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _file_bytes(path: Path) -> int:
    """Bytes of a regular file; 0 for anything else (never opens it: a FIFO would block)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def auto_jobs(files: list[Path]) -> int:
    """Worker processes for ``files``: one per CPU up to one per file, 1 below 32 MiB in all.

    Parallel reading needs the ``fork`` start method (Linux) and a process without
    other Python threads; elsewhere it is 1.
    """
    if (
        len(files) < 2
        or "fork" not in multiprocessing.get_all_start_methods()
        or threading.active_count() > 1  # forking a threaded process (a trainer) is unsafe
    ):
        return 1
    size = sum(_file_bytes(p) for p in files)
    return 1 if size < PARALLEL_MIN_BYTES else max(1, min(len(files), _cpus()))


def summarize(
    paths_or_dir: str | PathLike[str] | Iterable[str | PathLike[str]],
    *,
    ranks: Iterable[int] | None = None,
    steps: Iterable[int] | None = None,
    top: int = 20,
    jobs: int | None = None,
) -> ReportSummary:
    """Stream the diagnostics files and aggregate them (memory flat in file size).

    paths_or_dir: a directory (its ``media_guard.rank*.jsonl``), a file, or several.
    ranks, steps: keep only records of these global ranks / steps (a record without
    a rank takes the rank in its file name; without a step it fails any step filter).
    jobs: processes reading files in parallel (None: :func:`auto_jobs`; 1: this process).
    The result does not depend on ``jobs``. Raises MediaInputError when a path does not exist.
    """
    files = find_files(paths_or_dir)
    agg = _Aggregator(ranks, steps)
    jobs = auto_jobs(files) if jobs is None else max(1, min(jobs, len(files)))
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        tasks = [(p, i, agg.ranks, agg.steps) for i, p in enumerate(files)]
        try:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                for part in pool.map(_read_one, tasks):
                    agg.merge(part)
            return agg.summary(files, top)
        except (OSError, BrokenProcessPool):  # no processes here: read serially
            agg = _Aggregator(agg.ranks, agg.steps)
    for i, path in enumerate(files):
        agg.read(path, i)
    return agg.summary(files, top)
