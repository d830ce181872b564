"""The JSON description of an untrusted bundle, checked field by field before any object is
built from it: wrong types and sizes become one :class:`~.bundle_limits.LimitError` line
naming the field, not a traceback from deep inside the replay."""

from __future__ import annotations

from collections.abc import Mapping

from .bundle_limits import LimitError

MAX_ITEMS = 100_000
MAX_FEATURES = 1 << 40  # feature rows one item may declare
MAX_INDEX = 1 << 31  # samples, frames, grid sides, parallel coordinates
MAX_NAME = 64  # modality, layout, grammar name
MAX_TEXT = 4096  # log path, creation time


def _int(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v < hi


def _text(n: int):
    return lambda v: isinstance(v, str) and len(v) <= n


def _ints_or_none(n: int):
    return lambda v: (
        v is None or (isinstance(v, list) and len(v) == n and all(_int(x, 0, 1 << 31) for x in v))
    )


_INDEX = f"an int in [0, {MAX_INDEX}) or null"
_NAME = f"a string of at most {MAX_NAME} characters"
_ITEM_KEYS = {  # key -> (valid, what it must be)
    "num_features": (lambda v: _int(v, 0, MAX_FEATURES), f"an int in [0, {MAX_FEATURES})"),
    "sample": (lambda v: v is None or _int(v, 0, MAX_INDEX), _INDEX),
    "num_frames": (lambda v: v is None or _int(v, 0, MAX_INDEX), _INDEX),
    "modality": (_text(MAX_NAME), _NAME),
    "layout": (_text(MAX_NAME), _NAME),
    "frame_hw": (_ints_or_none(2), "a list of 2 ints >= 0 or null"),
    "source_hw": (_ints_or_none(2), "a list of 2 ints >= 0 or null"),
    "grid_thw": (_ints_or_none(3), "a list of 3 ints >= 0 or null"),
}


def _fail(where: str, value: object, want: str) -> LimitError:
    shown = (
        repr(value) if isinstance(value, (int, float, bool, type(None))) else type(value).__name__
    )
    return LimitError(f"{where}: expected {want}, got {shown[:40]}")


def check_meta(meta: object) -> None:
    """Raises :class:`LimitError` naming the first field of the wrong type or size."""
    if not isinstance(meta, dict):
        raise _fail("metadata", meta, "a JSON object")
    for key in ("step", "microbatch"):
        v = meta.get(key)
        if v is not None and not _int(v, 0, 1 << 62):
            raise _fail(key, v, "an int >= 0 or null")
    for key in ("log_path", "created"):
        v = meta.get(key)
        if v is not None and not _text(MAX_TEXT)(v):
            raise _fail(key, v, f"a string of at most {MAX_TEXT} characters or null")
    _check_tensors(meta.get("tensors"))
    _check_items(meta.get("items"))
    _check_grammar(meta.get("grammar"))
    _check_rank(meta.get("rank"))
    config = meta.get("config")
    if config is not None and not isinstance(config, dict):
        raise _fail("config", config, "an object or null")
    _check_report(meta.get("report"))


def _check_tensors(tensors: object) -> None:
    if not isinstance(tensors, dict):
        raise _fail("tensors", tensors, "an object of name -> {dtype, shape}")
    for name, spec in tensors.items():
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(_int(s, 0, 1 << 48) for s in spec["shape"])
        ):
            raise _fail(f"tensors[{name[:40]!r}]", spec, "{dtype: str, shape: [int, ...]}")


def _check_items(items: object) -> None:
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise _fail("items", items, f"a list of at most {MAX_ITEMS:,} objects")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _fail(f"items[{i}]", item, "an object")
        for key, (valid, want) in _ITEM_KEYS.items():
            if key in item and not valid(item[key]):
                raise _fail(f"items[{i}].{key}", item[key], want)
        pixels = item.get("pixels")
        if pixels is not None and not isinstance(pixels, dict):
            raise _fail(f"items[{i}].pixels", pixels, "an object or null")


def _check_grammar(g: object) -> None:
    if not isinstance(g, dict):
        raise _fail("grammar", g, "an object")
    ph = g.get("placeholders")
    if not isinstance(ph, dict) or not ph or len(ph) > 64:
        raise _fail("grammar.placeholders", ph, "an object of modality -> token id")
    for key in ("start_id", "end_id"):
        if g.get(key) is not None and type(g.get(key)) is not int:
            raise _fail(f"grammar.{key}", g.get(key), "an int or null")
    breaks = g.get("break_ids")
    if not isinstance(breaks, list) or len(breaks) > 64:
        raise _fail("grammar.break_ids", breaks, "a list of token ids")
    if not isinstance(g.get("collapsed"), bool):
        raise _fail("grammar.collapsed", g.get("collapsed"), "true or false")
    if not _text(MAX_NAME)(g.get("name")):
        raise _fail("grammar.name", g.get("name"), _NAME)
    for key in ("regions", "inner"):  # absent in bundles written before they existed
        pairs = g.get(key, [])
        if (
            not isinstance(pairs, list)
            or len(pairs) > 16
            or not all(
                isinstance(p, list) and len(p) == 2 and all(type(t) is int for t in p)
                for p in pairs
            )
        ):
            raise _fail(f"grammar.{key}", pairs, "a list of [start, end] token id pairs")
    aliases = g.get("aliases", {})
    if (
        not isinstance(aliases, dict)
        or len(aliases) > 64
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_NAME
            for k, v in aliases.items()
        )
    ):
        raise _fail("grammar.aliases", aliases, "an object of modality -> modality")


def _check_rank(rank: object) -> None:
    if rank is None:
        return
    if not isinstance(rank, dict) or not set(rank) <= {"rank", "tp", "pp", "dp", "cp"}:
        raise _fail("rank", rank, "an object with keys rank/tp/pp/dp/cp")
    for key, v in rank.items():
        if v is not None and not _int(v, 0, MAX_INDEX):
            raise _fail(f"rank.{key}", v, "an int >= 0 or null")


def _check_report(report: object) -> None:
    if not isinstance(report, Mapping):
        raise _fail("report", report, "an object")
    bad = report.get("mismatched", [])
    if not isinstance(bad, list):
        raise _fail("report.mismatched", bad, "a list")
    for i, m in enumerate(bad):
        if not isinstance(m, dict) or not _int(m.get("sample"), 0, MAX_INDEX):
            raise _fail(f"report.mismatched[{i}].sample", m, "an int >= 0")
