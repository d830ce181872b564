"""Per-rank diagnostics: one JSONL file per rank, schema v1 (docs/DIAGNOSTICS.md).

Every guard decision worth a post-mortem is one :class:`GuardRecord`; a
:class:`DiagnosticsLog` turns it into one JSON object per line in
``<log_dir>/media_guard.rank{global_rank:05d}.jsonl`` and logs a one-line human
summary through the ``megatron_media_guard`` logger.

Guarantees (the merge relies on them, it raises right after ``emit``):

- the line is written with one ``os.write`` on an ``O_APPEND`` descriptor and
  ``os.fsync``-ed before :meth:`DiagnosticsLog.emit` returns;
- a line is strict JSON (no NaN/Infinity: non-finite floats become null);
- nothing in a record is raw pixel or text content: the writer takes only the
  fields of :class:`GuardRecord` (counts, shapes, indices, ids, short names), and
  ``extra`` is reduced to JSON scalars, lists and flat mappings; any other object
  is written as ``"<TypeName>"``, never its contents.

This module never imports torch or torch.distributed.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Literal, get_args

from ..errors import MediaInputError

EventName = Literal["check", "repair", "drop", "raise", "budget", "consensus", "step"]
EVENTS: tuple[str, ...] = get_args(EventName)
SCHEMA_VERSION = 1
LOGGER_NAME = "megatron_media_guard"
FILE_PREFIX = "media_guard.rank"
FILE_SUFFIX = ".jsonl"

# Events a human should see even at WARNING level.
_WARN_EVENTS = frozenset({"drop", "raise", "budget", "repair"})
_MAX_STR = 4096  # longest string written (sample ids, reasons); longer ones are cut
_MAX_LIST = 4096  # longest list written; longer ones are cut
_MAX_DEPTH = 3  # nesting kept in ``extra``
_MAX_INT = 1 << 64  # larger integers are written as their size, never their digits


@dataclass(frozen=True)
class RankInfo:
    """Where a record comes from: global rank and parallel coordinates (None when unknown)."""

    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankInfo:
        """Global rank from ``RANK`` (set by torchrun) when it is an integer; the rest None.

        Never imports torch.distributed: the parallel coordinates are the caller's to fill.
        """
        env = os.environ if environ is None else environ
        try:
            rank = int(env["RANK"])
        except (KeyError, ValueError):
            rank = None
        return cls(rank=rank)


@dataclass(frozen=True)
class GuardRecord:
    """One diagnostic event. Lengths are token/feature counts, never content.

    expected: placeholder run lengths found in the token ids, in order.
    got: feature lengths of the media items, in order.
    frame_hw: (height, width) in pixels of the media (per frame for video).
    grid: the feature grid, e.g. (t, h, w) or (rows, cols).
    extra: JSON-safe scalars/lists keyed by short names; written under ``"extra"``.
    """

    event: EventName
    step: int | None = None
    microbatch: int | None = None
    sample: int | None = None
    sample_id: str | int | None = None
    row: int | None = None
    item: int | None = None
    modality: str | None = None
    expected: tuple[int, ...] | None = None
    got: tuple[int, ...] | None = None
    first_mismatch: int | None = None
    num_frames: int | None = None
    frame_hw: tuple[int, int] | None = None
    grid: tuple[int, ...] | None = None
    tiles: int | None = None
    action: str | None = None
    fidelity: str | None = None
    reason: str | None = None
    duration_ms: float | None = None
    extra: Mapping[str, object] | None = None

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise MediaInputError(
                f"unknown diagnostics event {self.event!r}; expected one of {list(EVENTS)}",
                context={"event": str(self.event)},
            )


# The record fields in schema order, after the envelope (schema .. microbatch, event).
_RECORD_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(GuardRecord) if f.name not in ("event", "step", "microbatch", "extra")
)
SCHEMA_KEYS: tuple[str, ...] = (
    "schema",
    "time",
    "host",
    "pid",
    "rank",
    "tp",
    "pp",
    "dp",
    "cp",
    "step",
    "microbatch",
    "event",
    *_RECORD_FIELDS,
    "caller",
)
"""Keys present in every schema-v1 line, in the order written (``extra`` follows when given)."""


def json_safe(value: object, depth: int = 0) -> object:
    """``value`` reduced to strict-JSON data: finite numbers, short strings, lists, flat dicts.

    Non-finite floats become None; numpy/torch scalars become Python numbers; any
    other object becomes ``"<TypeName>"`` (its contents are never written).
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value if len(value) <= _MAX_STR else value[:_MAX_STR] + "..."
    if isinstance(value, numbers.Integral):
        v = int(value)
        return v if -_MAX_INT < v < _MAX_INT else f"<int of {v.bit_length()} bits>"
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if depth < _MAX_DEPTH:
        if isinstance(value, (list, tuple)):
            return [json_safe(v, depth + 1) for v in value[:_MAX_LIST]]
        if isinstance(value, Mapping):
            return {str(k): json_safe(v, depth + 1) for k, v in list(value.items())[:_MAX_LIST]}
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            return json_safe(value.item(), depth + 1)  # a 0-d tensor or array
    return f"<{type(value).__name__}>"


def build_record(
    record: GuardRecord,
    rank: RankInfo,
    *,
    time: str,
    host: str,
    pid: int,
    caller: str | None,
) -> dict[str, object]:
    """The schema-v1 object for ``record`` (a pure function: no I/O)."""
    out: dict[str, object] = {
        "schema": SCHEMA_VERSION,
        "time": time,
        "host": host,
        "pid": pid,
        "rank": json_safe(rank.rank),
        "tp": json_safe(rank.tp),
        "pp": json_safe(rank.pp),
        "dp": json_safe(rank.dp),
        "cp": json_safe(rank.cp),
        "step": json_safe(record.step),
        "microbatch": json_safe(record.microbatch),
        "event": record.event,
    }
    for name in _RECORD_FIELDS:
        out[name] = json_safe(getattr(record, name))
    out["caller"] = caller
    if record.extra is not None:
        out["extra"] = json_safe(dict(record.extra))
    return out


def utc_now() -> str:
    """Current time, ISO-8601 UTC with microseconds (``2026-05-09T07:35:25.123456+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def file_name(rank: int | None) -> str:
    """``media_guard.rank{rank:05d}.jsonl``; an unknown rank is written as 0."""
    return f"{FILE_PREFIX}{(rank or 0):05d}{FILE_SUFFIX}"


def json_dumps(rec: Mapping[str, object]) -> str:
    """Compact strict JSON for one record (raises ValueError on NaN: sanitize first)."""
    return json.dumps(rec, separators=(",", ":"), allow_nan=False)


# -- human summary ------------------------------------------------------------------
def _clean(value: object, limit: int = 200) -> str:
    """One line of at most ``limit`` characters, cut at a word boundary when one is near."""
    try:
        raw = value if isinstance(value, str) else str(value)
    except Exception:  # a hostile __str__, an int too long to print
        raw = f"<{type(value).__name__}>"
    text = " ".join(raw[: 4 * limit + 16].split())
    return cut_words(text, limit)


def cut_words(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a word boundary when one is in the
    second half, marked with ``...``."""
    if len(text) <= limit:
        return text
    head = text[: limit - 3]
    space = head.rfind(" ")
    if space >= limit // 2:
        head = head[:space]
    return head.rstrip(" ,;:-") + "..."


def _repr(value: object) -> str:
    try:
        return repr(value) if isinstance(value, (str, int)) else _clean(value, 80)
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"


def _ints(value: object) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return value


def _compact(values: list[int], limit: int = 8) -> str:
    """``[2010 x16]`` for repeats, the list itself when short, else its head and a count."""
    groups: list[tuple[int, int]] = []
    for v in values:
        if groups and groups[-1][0] == v:
            groups[-1] = (v, groups[-1][1] + 1)
        else:
            groups.append((v, 1))
    parts = [str(v) if n == 1 else f"{v} x{n}" for v, n in groups]
    if len(parts) > limit:
        parts = [*parts[:limit], f"... +{len(parts) - limit} more"]
    return "[" + ", ".join(parts) + "]"


def _lengths(label: str, noun: str, value: object) -> str | None:
    ints = _ints(value)
    if ints is None:
        return None if value is None else f"{label} {_clean(value, 80)}"
    if len(ints) <= 1:
        return f"{label} {_compact(ints)}"
    return f"{label} {len(ints)} {noun} {_compact(ints)} = {sum(ints)}"


def summary_line(rec: Mapping[str, object]) -> str:
    """One line for a record dict (tolerates missing and mistyped fields).

    ``[media-guard] rank 3 step 12 mb 0: drop sample 5 (id 'abc') row 1 item 2 image:
    expected [2010] got [2550], first mismatch run 0, surplus 540 - <reason>; action ...``
    """
    g = rec.get
    rank = g("rank")
    head = f"[media-guard] rank {'?' if rank is None else _clean(rank, 20)}"
    if g("step") is not None:
        head += f" step {_clean(g('step'), 20)}"
    if g("microbatch") is not None:
        head += f" mb {_clean(g('microbatch'), 20)}"
    subject = [_clean(g("event", "?"), 20)]
    if g("sample") is not None:
        subject.append(f"sample {_clean(g('sample'), 20)}")
    sid = g("sample_id")
    if sid is not None:
        subject.append(f"(id {_clean(_repr(sid), 80)})")
    for key in ("row", "item"):
        if g(key) is not None:
            subject.append(f"{key} {_clean(g(key), 20)}")
    if g("modality") is not None:
        subject.append(_clean(g("modality"), 20))
    line = f"{head}: {' '.join(subject)}"

    facts = [
        s
        for s in (
            _lengths("expected", "runs", g("expected")),
            _lengths("got", "items", g("got")),
        )
        if s
    ]
    detail = ", ".join(facts)
    if g("first_mismatch") is not None:
        detail += f", first mismatch run {_clean(g('first_mismatch'), 20)}"
    exp, got = _ints(g("expected")), _ints(g("got"))
    if exp is not None and got is not None and exp != got:
        delta = sum(got) - sum(exp)
        detail += (
            f", surplus {delta}"
            if delta > 0
            else f", deficit {-delta}"
            if delta < 0
            else ", equal totals"
        )
    if detail:
        line += f": {detail.lstrip(', ')}"
    if g("reason"):
        line += f" - {_clean(g('reason'))}"

    tail = []
    if g("action") is not None and g("action") != g("event"):
        tail.append(f"action {_clean(g('action'), 40)}")
    if g("fidelity") is not None:
        tail.append(f"fidelity {_clean(g('fidelity'), 40)}")
    grid = _ints(g("grid"))
    if grid:
        tail.append("grid " + "x".join(map(str, grid)))
    if g("tiles") is not None:
        tail.append(f"tiles {_clean(g('tiles'), 20)}")
    hw = _ints(g("frame_hw"))
    frames = g("num_frames")
    if frames is not None or hw:
        media = f"{_clean(frames, 20)} frames" if frames is not None else "media"
        tail.append(media + (f" {hw[0]}x{hw[1]} (HxW)" if hw and len(hw) == 2 else ""))
    ms = g("duration_ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool):
        tail.append(f"{ms:.3g} ms")
    extra = g("extra")
    if isinstance(extra, Mapping) and extra:
        tail.append("extra " + _clean(", ".join(f"{k}={v}" for k, v in extra.items()), 160))
    if tail:
        line += "; " + "; ".join(tail)
    return line
