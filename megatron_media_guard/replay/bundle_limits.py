"""What an untrusted bundle may declare, checked before anything is built from it: tensor
sizes before and after loading, token ids, the JSON description field by field (docs/
DIAGNOSTICS.md, "media-guard replay BUNDLE on bundles you did not write"); torch-free. A wrong
field or size is one :class:`LimitError` line naming it, not a traceback from the replay.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from collections.abc import Callable, Mapping
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


Valid = Callable[[object], bool]


def _int(lo: int, hi: int) -> Valid:
    return lambda v: type(v) is int and lo <= v < hi


def _text(n: int) -> Valid:
    return lambda v: isinstance(v, str) and len(v) <= n


def _list(valid: Valid, most: int, *, exactly: bool = False) -> Valid:
    return lambda v: (
        isinstance(v, list)
        and (len(v) == most if exactly else len(v) <= most)
        and all(valid(x) for x in v)
    )


_SHAPE = _list(_int(0, 1 << 48), 8)


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


def max_bytes_from_env() -> int:
    raw = os.environ.get(ENV_MAX_BYTES, "").strip()
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
        if not _SHAPE(shape):
            raise LimitError(f"tensor {name!r}: shape {str(shape)[:60]} is not a list of sizes")
        numel = math.prod(shape)
        if not _list(_int(0, data + 1), 2, exactly=True)(offsets) or (
            offsets[1] - offsets[0] != numel * item
        ):
            raise LimitError(
                f"tensor {name!r}: data offsets do not match shape {shape} in the file"
            )
        total += numel * item
        _check_size(name, numel, shape, total, max_bytes)


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


def _dict(v: object) -> bool:
    return isinstance(v, dict)


def _or_null(valid: Valid) -> Valid:
    return lambda v: v is None or valid(v)


_TOKEN = _int(-(1 << 63), 1 << 63)
_INDEX = (_or_null(_int(0, MAX_INDEX)), f"an int in [0, {MAX_INDEX}) or null")
_NAME = (_text(MAX_NAME), f"a string of at most {MAX_NAME} characters")
_PAIRS = (_list(_list(_TOKEN, 2, exactly=True), 16), "a list of [start, end] token id pairs")
_COUNT = (_or_null(_int(0, 1 << 62)), "an int >= 0 or null")
_TEXT = (_or_null(_text(MAX_TEXT)), f"a string of at most {MAX_TEXT} characters or null")
_OBJECT = (_or_null(_dict), "an object or null")


def _sizes(n: int) -> tuple[Valid, str]:
    return _or_null(_list(_int(0, 1 << 31), n, exactly=True)), f"a list of {n} ints >= 0 or null"


# each object's keys -> (valid, what it must be), checked where present; the keys a bundle
# written before they existed lacks take their defaults
_META = {
    "step": _COUNT,
    "microbatch": _COUNT,
    "log_path": _TEXT,
    "created": _TEXT,
    "config": _OBJECT,
}
_ITEM = {
    "num_features": (_int(0, MAX_FEATURES), f"an int in [0, {MAX_FEATURES})"),
    "sample": _INDEX,
    "num_frames": _INDEX,
    "modality": _NAME,
    "layout": _NAME,
    "frame_hw": _sizes(2),
    "source_hw": _sizes(2),
    "grid_thw": _sizes(3),
    "pixels": _OBJECT,
}
_GRAMMAR = {
    "placeholders": (
        lambda v: _dict(v) and 0 < len(v) <= 64,
        "an object of modality -> token id",
    ),
    "start_id": (_or_null(_TOKEN), "an int or null"),
    "end_id": (_or_null(_TOKEN), "an int or null"),
    "break_ids": (_list(_TOKEN, 64), "a list of token ids"),
    "collapsed": (lambda v: isinstance(v, bool), "true or false"),
    "name": _NAME,
    "regions": _PAIRS,
    "inner": _PAIRS,
    "aliases": (
        lambda v: (
            _dict(v)
            and len(v) <= 64
            and all(map(_NAME[0], v))
            and all(isinstance(x, str) for x in v.values())
        ),
        "an object of modality -> modality",
    ),
}
_GRAMMAR_REQUIRED = ("placeholders", "break_ids", "collapsed", "name")
_RANK = dict.fromkeys(("rank", "tp", "pp", "dp", "cp"), _INDEX)
_REPORT = {
    "mismatched": (
        _list(lambda m: _dict(m) and _int(0, MAX_INDEX)(m.get("sample")), MAX_ITEMS),
        "a list of objects with a sample: int >= 0",
    )
}
_TENSOR = {
    "dtype": (_text(MAX_NAME), "a dtype name"),
    "shape": (_SHAPE, "a list of at most 8 sizes"),
}


def _fail(where: str, value: object, want: str) -> LimitError:
    shown = (
        repr(value) if isinstance(value, (int, float, bool, type(None))) else type(value).__name__
    )
    return LimitError(f"{where}: expected {want}, got {shown[:40]}")


def _check_object(
    where: str, obj: object, keys: Mapping[str, tuple[Valid, str]], required=(), want="an object"
) -> None:
    if not isinstance(obj, dict):
        raise _fail(where, obj, want)
    for key, (valid, what) in keys.items():
        if (key in obj or key in required) and not valid(obj.get(key)):
            raise _fail(f"{where}.{key}", obj.get(key), what)


def check_meta(meta: object) -> None:
    """Raises :class:`LimitError` naming the first field of the wrong type or size."""
    _check_object("metadata", meta, _META, want="a JSON object")
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict):
        raise _fail("tensors", tensors, "an object of name -> {dtype, shape}")
    for name, spec in tensors.items():
        _check_object(f"tensors[{name[:40]!r}]", spec, _TENSOR, required=_TENSOR)
    items = meta.get("items")
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise _fail("items", items, f"a list of at most {MAX_ITEMS:,} objects")
    for i, item in enumerate(items):
        _check_object(f"items[{i}]", item, _ITEM)
    _check_object("grammar", meta.get("grammar"), _GRAMMAR, _GRAMMAR_REQUIRED)
    rank = meta.get("rank")
    if rank is not None and not (_dict(rank) and set(rank) <= set(_RANK)):
        raise _fail("rank", rank, "an object with keys rank/tp/pp/dp/cp")
    if rank is not None:
        _check_object("rank", rank, _RANK)
    _check_object("report", meta.get("report"), _REPORT)
