"""Reading rank files for the post-mortem: safely (:func:`open_rank_file` opens only regular
files, non-blocking, and says why it skipped anything else) and fast (:class:`LineTemplates`).

The fast path (docs/DIAGNOSTICS.md, "Memory and speed"): a writer-shaped line is cut into its
*template* (the line less its ``time``, ``step`` and ``microbatch`` values) and those values.
A template's facts are stored only after a full parse of its line and a probe: the template
re-filled with sentinels parses to the same object with exactly those three fields changed,
so its cut positions are the structural fields, not text inside a string. A later line with
the same template and valid value tokens then has the stored facts, unparsed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
from pathlib import Path

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
MAX_TEMPLATE_LINE = 4096  # longer lines are always parsed (their templates would cost memory)
MAX_TEMPLATES = 8192  # the cache is cleared when full: memory stays bounded
PROBE_LINES = 8192  # after this many lines of a file, a fast path that cannot hit is off
_SCAN = json.JSONDecoder().scan_once  # C scanner: parse one value at an index, no wrapper

LINE_OK, LINE_BAD, LINE_TORN, LINE_BLANK = "ok", "bad", "torn", "blank"


def open_rank_file(path: Path) -> tuple[io.TextIOWrapper | None, str | None]:
    """``(text file, None)`` for a regular file, else ``(None, why it is skipped)``.

    Never blocks: the open is non-blocking (a FIFO without a writer opens at once) and
    anything but a regular file (FIFO, device, directory, socket) is refused by ``fstat``.
    Invalid UTF-8 is kept as lone surrogates (``surrogateescape``), for the reader to count
    the line as malformed.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:  # dangling symlink, symlink loop, unreadable, vanished
        return None, err.strerror or type(err).__name__
    try:
        mode = os.fstat(fd).st_mode
    except OSError as err:
        os.close(fd)
        return None, err.strerror or type(err).__name__
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None, f"not a regular file ({_kind(mode)})"
    with contextlib.suppress(OSError, AttributeError):  # regular files never block anyway
        os.set_blocking(fd, True)
    return open(fd, encoding="utf-8", errors="surrogateescape", newline="\n"), None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "special file"


def parse_line(line: str, loads=json.loads) -> tuple[str, dict | None]:
    """``(LINE_OK, record)``, or ``(LINE_BAD | LINE_TORN | LINE_BLANK, None)``.

    Malformed (``LINE_BAD``): not JSON, JSON that is not an object, nesting too deep for the
    parser, invalid UTF-8. ``LINE_TORN``: a line without its newline that does not parse (the
    reader counts it torn when it is the last line of a file after valid records, else
    malformed). A whole record whose newline is missing is a record.
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


def probe_ok(template: tuple[str, str], rec: dict) -> bool:
    """The template's cut positions are the structural time/step/microbatch of ``rec``: the
    template re-filled with sentinels parses to ``rec`` with exactly those fields changed."""
    middle, tail = template
    probe = f'{{"schema":1,"time":"T"{middle},"step":0,"microbatch":0,{tail}'
    try:
        again = json.loads(probe)
    except (ValueError, RecursionError):
        return False
    return again == {**rec, "time": "T", "step": 0, "microbatch": 0}


class LineTemplates:
    """Facts of verified templates (see the module docstring); bounded.

    A template is probed (a second parse) only when it is seen for the second time, so lines
    that never repeat cost one parse each, as without the fast path; and a file whose first
    :data:`PROBE_LINES` lines are nearly all distinct templates stops cutting lines at all
    (``useful``)."""

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
        if not probe_ok(template, rec):
            return
        if len(self.facts) >= MAX_TEMPLATES:
            self.facts.clear()
        self.facts[template] = facts
