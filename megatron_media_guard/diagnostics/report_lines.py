"""Reading rank files for the post-mortem: safely (:func:`open_rank_file`), each record reduced
to the bounded facts the counters take (:func:`record_facts`), and fast (:class:`LineTemplates`:
a writer-shaped line's facts stored under its *template*, the line less its ``time``, ``step``
and ``microbatch`` values, once a probe proves the cuts structural; docs/DIAGNOSTICS.md,
"Memory and speed").
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from .log import open_regular
from .report_grid import _LABEL_LEN, NONE_LABEL, _label

MAX_TEMPLATE_LINE = 4096  # longer lines are always parsed (their templates would cost memory)
MAX_TEMPLATES = 8192  # the cache is cleared when full: memory stays bounded
PROBE_LINES = 8192  # after this many lines of a file, a fast path that cannot hit is off
_INT = r"(?:0|[1-9][0-9]*|null)"
# a writer-shaped line: group 1 the text between time and step, group 2 the step token,
# ``m.end()`` the start of the tail; its template is ``(group 1, line[m.end():])``
template_match = re.compile(
    r'\{"schema":1,"time":"[\x20\x21\x23-\x5b\x5d-\x7e]*"(.*?),"step":('
    + _INT
    + '),"microbatch":'
    + _INT
    + ",",
    re.ASCII,
).match
OFFENDING_EVENTS = frozenset({"repair", "drop", "raise"})
_SID_LEN = 200  # longer string sample ids are cut in the summary
_SID_INT = 1 << 63
_SCAN = json.JSONDecoder().scan_once  # C scanner: parse one value at an index, no wrapper
LINE_OK, LINE_BAD, LINE_TORN, LINE_BLANK = "ok", "bad", "torn", "blank"


def open_rank_file(path: Path) -> tuple[io.TextIOWrapper | None, str | None]:
    """``(text file, None)`` for a regular file, else ``(None, why it is skipped)``; never
    blocks (see :func:`.log.open_regular`). Invalid UTF-8 is kept as lone surrogates
    (``surrogateescape``), for the reader to count the line as malformed."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError as err:  # not a regular file, dangling symlink, loop, unreadable, vanished
        return None, err.strerror or str(err) or type(err).__name__
    return open(fd, encoding="utf-8", errors="surrogateescape", newline="\n"), None


def parse_line(line: str, loads=json.loads) -> tuple[str, dict | None]:
    """``(LINE_OK, record)``, or ``(LINE_BAD | LINE_TORN | LINE_BLANK, None)``.

    Malformed (``LINE_BAD``): not JSON, not an object, nested too deep, invalid UTF-8.
    ``LINE_TORN``: a line without its newline that does not parse (torn when it is a file's
    last line after valid records, else malformed). A whole record without its newline is a
    record.
    """
    try:
        rec, end = _SCAN(line, 0)
        rest = line[end:]
        if rest and rest != "\n":
            raise ValueError(line)
    except (StopIteration, ValueError, RecursionError):
        try:
            rec = loads(line)
        except (ValueError, RecursionError):
            if line[-1:] != "\n" and line.strip():
                return LINE_TORN, None
            rec = None
    if type(rec) is not dict:
        return (LINE_BAD if line.strip() else LINE_BLANK), None
    if not line.isascii():
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # invalid UTF-8, decoded to lone surrogates
            return LINE_BAD, None
    return LINE_OK, rec


class LineTemplates:
    """Facts of templates whose probe (the template re-filled with sentinels parses to the same
    object with exactly those three fields changed) proved its cut positions the structural
    fields, not text inside a string; bounded.

    A template is probed (a second parse) only when seen for the second time, so lines that
    never repeat cost one parse each; a file whose first :data:`PROBE_LINES` lines are nearly
    all distinct templates stops cutting lines at all (``useful``)."""

    def __init__(self) -> None:
        self.facts: dict[tuple[str, str], tuple] = {}
        self.seen: set[tuple[str, str]] = set()

    def useful(self, lines: int) -> bool:
        """Worth going on: at most 3/4 of the lines so far were distinct templates."""
        return 4 * len(self.seen) <= 3 * lines  # every stored template was seen first

    def add(self, template: tuple[str, str], rec: dict, facts: tuple) -> None:
        if template not in self.seen:
            if len(self.seen) >= 2 * MAX_TEMPLATES:
                self.seen.clear()
            self.seen.add(template)
            return
        middle, tail = template
        probe = f'{{"schema":1,"time":"T"{middle},"step":0,"microbatch":0,{tail}'
        try:
            again = json.loads(probe)
        except (ValueError, RecursionError):
            return
        if again != {**rec, "time": "T", "step": 0, "microbatch": 0}:
            return  # the cut positions are not the structural time/step/microbatch
        if len(self.facts) >= MAX_TEMPLATES:
            self.facts.clear()
        self.facts[template] = facts


def _small(value: object) -> object:
    """An int as is, anything else (None aside) as a short label: an item description."""
    return value if value is None or type(value) is int else _label(value, 40)


def _size(value: object) -> str | None:
    """``[h, w]`` as ``"HxW"``, anything else a short label (None stays None)."""
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return f"{value[0]}x{value[1]}"
    return _label(value, 40)


def record_facts(rec: dict, reason_class: Callable[[object], str]) -> tuple:
    """What the counters need from a record, every string bounded: (rank or None, event,
    action, reason class, sample id or None, schema is 1, (modality, family), the item
    (modality, item, frames, size, fidelity, family)); ``reason_class`` of a non-None reason."""
    get = rec.get
    rank, event, action, reason, sid = map(get, ("rank", "event", "action", "reason", "sample_id"))
    if type(rank) is not int:
        rank = None
    if type(event) is not str or len(event) > _LABEL_LEN:
        event = _label(event)
    if type(action) is not str or len(action) > _LABEL_LEN:
        action = _label(action)
    reason = NONE_LABEL if reason is None else reason_class(reason)
    if sid is not None and event in OFFENDING_EVENTS:
        if type(sid) is str:
            if len(sid) > _SID_LEN:
                sid = sid[:_SID_LEN] + "..."
        elif type(sid) is not int or not -_SID_INT < sid < _SID_INT:
            sid = _label(sid)
    else:
        sid = None
    extra = get("extra")
    extra = extra if isinstance(extra, dict) else {}
    family = get("family")
    if family is None:  # else the adapter's extra says it
        family = extra.get("family", extra.get("adapter"))
    modality, family = _label(get("modality"), 40), _label(family, 40)
    hw = get("frame_hw")
    if hw is None:
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
