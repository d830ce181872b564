"""What an untrusted bundle may declare, bounded before anything is allocated (docs/
DIAGNOSTICS.md, "media-guard replay BUNDLE on bundles you did not write"): a safetensors
header's tensors (dtype, shape and data offsets consistent, inside the file) and a torch zip's
declared uncompressed sizes, each summed against the limit, then the loaded tensors' logical
sizes (a stride-0 view counts in full). The limit is ``DEFAULT_MAX_BYTES`` (1 GiB) unless given
(``--max-bytes``, ``MEDIA_GUARD_REPLAY_MAX_BYTES``); token ids get ``max_bytes //
BYTES_PER_TOKEN`` at most, the replay's parse working at about 40 bytes per token.
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
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
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
