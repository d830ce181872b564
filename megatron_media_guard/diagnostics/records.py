"""Schema v1 of the per-rank diagnostics (docs/DIAGNOSTICS.md): :class:`GuardRecord`, where it
comes from (:class:`RankInfo`), its strict-JSON object (:func:`build_record`: counts, shapes,
indices, ids, short names; never pixel or text content) and its one human line
(:func:`summary_line`); :mod:`.log` writes them. Never imports torch.
"""

from __future__ import annotations

import itertools
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
        """Global rank from ``RANK`` (set by torchrun) when it is an integer; the rest None
        (never imports torch.distributed: the parallel coordinates are the caller's)."""
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
_RANK_FIELDS = tuple(f.name for f in fields(RankInfo))
SCHEMA_KEYS: tuple[str, ...] = (
    *("schema", "time", "host", "pid", *_RANK_FIELDS, "step", "microbatch", "event"),
    *_RECORD_FIELDS,
    "caller",
)
"""Keys present in every schema-v1 line, in the order written (``extra`` follows when given)."""


def json_safe(value: object, depth: int = 0) -> object:
    """``value`` reduced to strict-JSON data: finite numbers (non-finite: None; numpy/torch
    scalars: Python numbers), short strings, lists, flat dicts; any other object
    ``"<TypeName>"`` (its contents are never written)."""
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
    record: GuardRecord, rank: RankInfo, *, time: str, host: str, pid: int, caller: str | None
) -> dict[str, object]:
    """The schema-v1 object for ``record`` (a pure function: no I/O)."""
    out: dict[str, object] = {"schema": SCHEMA_VERSION, "time": time, "host": host, "pid": pid}
    for name in _RANK_FIELDS:
        out[name] = json_safe(getattr(rank, name))
    out["step"], out["microbatch"] = json_safe(record.step), json_safe(record.microbatch)
    out["event"] = record.event
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
def one_line(value: object, limit: int = 200) -> str:
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


def _ints(value: object) -> list[int] | None:
    """``value`` when it is a list of ints (a record's counts), else None."""
    ok = isinstance(value, list) and all(type(v) is int for v in value)
    return value if ok else None


def _compact(values: list[int], limit: int = 8) -> str:
    """``[2010 x16]`` for repeats, the list itself when short, else its head and a count."""
    runs = [(v, sum(1 for _ in same)) for v, same in itertools.groupby(values)]
    parts = [str(v) if n == 1 else f"{v} x{n}" for v, n in runs]
    if len(parts) > limit:
        parts = [*parts[:limit], f"... +{len(parts) - limit} more"]
    return "[" + ", ".join(parts) + "]"


#: how a record, a message or a report names a process without a rank (RANK unset, no
#: torch.distributed): the same words everywhere
SINGLE_PROCESS = "single process (RANK unset)"

#: an adapter's checks whose expected / got are placeholder and feature counts (others hold
#: positions or affected units, shown as they are)
_COUNT_CHECKS = ("count", "tiles")

#: a sample's statuses whose whole reason is the two counts (the line says them once)
_COUNT_STATUSES = ("surplus", "deficit", "count_mismatch", "length_mismatch")


def where_text(rank: object, step: object = None, microbatch: object = None) -> str:
    """``"rank 3, step 12, microbatch 0"`` (``"single process (RANK unset), ..."`` without a
    rank): the one way a record line, an exception and a report name a guarded call."""
    parts = [SINGLE_PROCESS if rank is None else f"rank {one_line(rank, 20)}"]
    if step is not None:
        parts.append(f"step {one_line(step, 20)}")
    if microbatch is not None:
        parts.append(f"microbatch {one_line(microbatch, 20)}")
    return ", ".join(parts)


def _counts(exp: list[int] | None, got: list[int] | None, first: object, status: object) -> str:
    """The two sides of a record once: ``3 placeholders vs 4 features (surplus 1)``, or per
    run with their totals, and the sample's status when the counts are its cause; nothing
    when they agree."""
    if (exp is None) != (got is None):  # one side only: shown as it is
        side = exp if exp is not None else got
        noun = "placeholder runs" if exp is not None else "item features"
        return f"{noun} {_compact(side)} = {sum(side)}"  # type: ignore[arg-type]
    if exp is None or got is None or exp == got:
        return ""
    if len(exp) <= 1 and len(got) <= 1:
        out = f"{sum(exp)} placeholders vs {sum(got)} features"
    else:
        out = (
            f"placeholder runs {_compact(exp)} = {sum(exp)} vs item features "
            f"{_compact(got)} = {sum(got)}"
        )
    delta = sum(got) - sum(exp)
    why = [f"surplus {delta}" if delta > 0 else f"deficit {-delta}" if delta else "equal totals"]
    if status in ("count_mismatch", "length_mismatch"):
        why[0] = f"{status}: {why[0]}"
    if len(exp) != len(got):
        runs = f"{len(exp)} run" + ("s" if len(exp) != 1 else "")
        why.append(f"{runs} for {len(got)} item" + ("s" if len(got) != 1 else ""))
    elif first is not None and (len(exp) > 1 or not delta):
        why.append(f"first mismatch at run {one_line(first, 20)}")
    return f"{out} ({', '.join(why)})"


#: a reason's share of the line: room for a repair's refusal with its facts (the record keeps it
#: whole, up to 4096 characters)
_REASON_CHARS = 400


def _reason(reason: object, counted: bool) -> str:
    """The record's reason less what the counts already say (``surplus: 4 features for 3
    placeholders (+1)`` once the line shows both counts)."""
    if not reason:
        return ""
    text = one_line(reason, _REASON_CHARS)
    if counted:
        keep = [c for c in text.split("; ") if c.split(":")[0] not in _COUNT_STATUSES]
        text = "; ".join(keep)
    return text


def _extra(extra: object, reason: str) -> str:
    """``extra``'s entries that add something: never ``status`` (the reason or the counts
    say it), ``findings`` / ``check`` only when the reason does not already hold them."""
    if not isinstance(extra, Mapping) or not extra:
        return ""
    out = []
    for k, v in extra.items():
        if k == "status":
            continue
        if k == "findings" and (not v or all(one_line(f) in reason for f in v)):
            continue
        if k == "check" and reason.startswith(f"{v}:"):
            continue
        if v is None or (isinstance(v, str) and one_line(v) in reason):  # said already
            continue
        out.append(f"{k}={v}")
    return one_line(", ".join(out), 160)


def _media(g) -> str:
    """What the record says of its item's media: frames, frame size, grid, tiles."""
    out = []
    hw = _ints(g("frame_hw"))
    frames = g("num_frames")
    size = f"{hw[0]}x{hw[1]} (HxW)" if hw and len(hw) == 2 else None
    if frames is not None:
        out.append(f"{one_line(frames, 20)} frames" + (f" of {size}" if size else ""))
    elif size:
        out.append(size)
    grid = _ints(g("grid"))
    if grid:
        out.append("grid " + "x".join(map(str, grid)))
    if g("tiles") is not None:
        out.append(f"{one_line(g('tiles'), 20)} tiles")
    return ", ".join(out)


def summary_line(rec: Mapping[str, object], *, where: bool = True) -> str:
    """The one line of a record, each fact once (where it is shown, its order and an example:
    docs/DIAGNOSTICS.md, "Console line"). Tolerates missing and mistyped fields.
    ``where=False``: without the ``[media-guard] <where>:`` head (a message names the where
    once, above)."""
    g = rec.get
    head = []
    if g("sample") is not None:
        head.append(f"sample {one_line(g('sample'), 20)}")
        sid = g("sample_id")
        if sid is not None:  # a string id quoted: ``'abc'`` is not ``abc``
            head.append(f"(sample_id {one_line(repr(sid) if isinstance(sid, str) else sid, 80)})")
    if g("row") is not None:
        head.append(f"row {one_line(g('row'), 20)}")
    media = _media(g)
    modality = one_line(g("modality"), 20) if g("modality") is not None else None
    if modality == "sample":  # a packed sub-sample's own fault: the sample says it
        modality = None
    item = None if g("item") is None else f"item {one_line(g('item'), 20)}"
    what = [x for x in (modality, item, f"({media})" if media else None) if x]
    subject = [" ".join(part) for part in (head, what) if part]
    exp, got = _ints(g("expected")), _ints(g("got"))
    extra = g("extra")
    status = extra.get("status") if isinstance(extra, Mapping) else None
    check = extra.get("check") if isinstance(extra, Mapping) else None
    if check is not None and check not in _COUNT_CHECKS and exp is not None and got is not None:
        counts = f"expected {_compact(exp)}, found {_compact(got)}"  # positions, units: as is
    else:
        counts = _counts(exp, got, g("first_mismatch"), status)
    odd = [  # a foreign file's fields that are no lists of ints: shown as they are
        f"{k} {one_line(g(k), 80)}"
        for k in ("expected", "got")
        if g(k) is not None and _ints(g(k)) is None
    ]
    reason = _reason(g("reason"), bool(counts))
    body = [x for x in (counts, *odd, reason) if x]
    shown = _extra(extra, reason)
    if shown:
        body.append(shown)
    if g("fidelity") is not None:
        body.append(f"fidelity {one_line(g('fidelity'), 40)}")
    ms = g("duration_ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool):
        body.append(f"{ms:.3g} ms")
    event = one_line(g("event", "?"), 20)
    action = None if g("action") is None else one_line(g("action"), 40)
    end = f" -> {event}" if action in (None, event) else f" -> {action} ({event})"
    if action is None and event not in ("drop", "raise", "repair"):  # else the event is the action
        end = ""  # a record of no decision (a step's counters): its event first
        subject.insert(0, event)
    line = ", ".join(subject)
    if body:
        line = f"{line}: {'; '.join(body)}" if line else "; ".join(body)
    line += end
    if where:
        line = f"[media-guard] {where_text(g('rank'), g('step'), g('microbatch'))}: {line}"
    return line
