"""What an untrusted bundle may declare, checked before anything is built from it (docs/
DIAGNOSTICS.md, "media-guard replay BUNDLE on bundles you did not write"); torch-free.

Sizes, before anything is allocated: a safetensors header's tensors (dtype, shape and data
offsets consistent, inside the file) and a torch zip's declared uncompressed sizes, each summed
against the limit, then the loaded tensors' logical sizes (a stride-0 view counts in full). The
limit is ``DEFAULT_MAX_BYTES`` (1 GiB) unless given (``--max-bytes``,
``MEDIA_GUARD_REPLAY_MAX_BYTES``); token ids get ``max_bytes // BYTES_PER_TOKEN`` at most.
The JSON description (:func:`check_meta`): each field's type and size, a wrong one one
:class:`LimitError` line naming the field, not a traceback from deep inside the replay.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

DEFAULT_MAX_BYTES = 1 << 30
MAX_HEADER_BYTES = 16 << 20  # the JSON header of a safetensors bundle (metadata included)
MAX_ZIP_ENTRIES = 4096
ENV_MAX_BYTES = "MEDIA_GUARD_REPLAY_MAX_BYTES"
BYTES_PER_TOKEN = 64  # replay working memory per token id, rounded up
_ID_TENSORS = ("input_ids", "cu_seqlens")

# safetensors dtype names -> bytes per element
_ST_SIZES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64"), 8),
}


class LimitError(ValueError):
    """The bundle declares more than the limit, or declares it inconsistently."""


def parse_max_bytes(raw: str, source: str) -> int:
    """The byte count ``raw`` (>= 1); a :class:`LimitError` naming ``source`` otherwise."""
    try:
        value = int(raw)
    except ValueError:
        raise LimitError(f"{source} must be an integer number of bytes, got {raw!r}") from None
    if value < 1:
        raise LimitError(f"{source} must be >= 1, got {value}")
    return value


def max_bytes_from_env(environ: Mapping[str, str] | None = None) -> int:
    raw = (os.environ if environ is None else environ).get(ENV_MAX_BYTES, "").strip()
    return parse_max_bytes(raw, ENV_MAX_BYTES) if raw else DEFAULT_MAX_BYTES


def _mib(n: int) -> str:
    """A byte count for a message: bytes below 1 MiB (``--max-bytes 10``: "10 bytes", not
    "0.0 MiB"), MiB above."""
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def check_safetensors(path: Path, max_bytes: int) -> None:
    """Refuses a safetensors file whose header declares more than ``max_bytes`` or lies."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise LimitError("file too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise LimitError(f"safetensors header declares {n:,} bytes (file {size:,} bytes)")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise LimitError(f"safetensors header is not JSON ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise LimitError("safetensors header is not a JSON object")
    data = size - 8 - n
    total = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict):
            raise LimitError(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        item = _ST_SIZES.get(dtype) if isinstance(dtype, str) else None
        if item is None:
            raise LimitError(f"tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
        numel = _numel(name, shape)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and 0 <= o <= data for o in offsets)
            or offsets[1] - offsets[0] != numel * item
        ):
            raise LimitError(
                f"tensor {name!r}: data offsets do not match shape {shape} in the file"
            )
        total += numel * item
        _check_size(name, numel, shape, total, max_bytes)


def _numel(name: str, shape: object) -> int:
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(type(s) is int and 0 <= s < 1 << 48 for s in shape)
    ):
        raise LimitError(f"tensor {name!r}: shape {str(shape)[:60]} is not a list of sizes")
    n = 1
    for s in shape:
        n *= s
    return n


def check_torch_zip(path: Path, max_bytes: int) -> None:
    """Refuses a torch zip whose entries declare more than ``max_bytes`` uncompressed."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise LimitError(f"not a readable zip ({type(err).__name__}: {err})") from None
    if len(infos) > MAX_ZIP_ENTRIES:
        raise LimitError(f"zip holds {len(infos):,} entries (at most {MAX_ZIP_ENTRIES:,})")
    total = sum(max(0, i.file_size) for i in infos)
    if total > max_bytes:
        raise LimitError(
            f"zip entries declare {_mib(total)} uncompressed, more than the limit of "
            f"{_mib(max_bytes)}"
        )


def check_loaded(tensors: Mapping[str, object], max_bytes: int) -> None:
    """Refuses loaded tensors whose logical sizes (numel x itemsize) exceed ``max_bytes``
    in all: a stride-0 view is counted at its full size, before anything expands it."""
    total = 0
    for name, t in tensors.items():
        numel = getattr(t, "numel", None)
        if numel is None:
            raise LimitError(f"entry {str(name)[:60]!r} is not a tensor")
        total += int(numel()) * int(t.element_size())
        _check_size(str(name), int(numel()), list(t.shape)[:8], total, max_bytes)


def _check_size(name: str, numel: int, shape: object, total: int, max_bytes: int) -> None:
    if total > max_bytes:
        raise LimitError(
            f"tensors declare more than the limit of {_mib(max_bytes)} "
            f"(tensor {name[:60]!r} shape {shape})"
        )
    if name in _ID_TENSORS and numel > max_bytes // BYTES_PER_TOKEN:
        raise LimitError(
            f"tensor {name!r} declares {numel:,} token ids, more than the "
            f"{max_bytes // BYTES_PER_TOKEN:,} the limit of {_mib(max_bytes)} admits "
            f"({BYTES_PER_TOKEN} bytes of replay memory per token)"
        )


# -- the metadata ----------------------------------------------------------------------
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
