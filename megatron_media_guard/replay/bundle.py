"""Replay bundle file format and :func:`load_bundle`: one failing micro-batch, saved
(:mod:`.bundle_save`) and loaded for ``media-guard replay`` (:mod:`.rerun`) to re-run the check
without a GPU, torch.distributed or the data pipeline. It holds the token ids, every
:class:`MediaItem` field but ``pixels``, the grammar, ``cu_seqlens``, the config's fields,
rank, step, microbatch, a summary of the alignment report and, optionally, the mismatched
items' pixels and features.

One file ``media_guard.rank{rank:05d}.step{step}.mb{microbatch}[.k].bundle`` (``k`` counts up
instead of overwriting): a safetensors file whose header metadata holds the JSON description
under ``"media_guard.bundle"``; without ``safetensors``, a ``torch.save`` zip of
``{"media_guard.bundle": json, "tensors": {name: tensor}}`` read back with
``torch.load(weights_only=True)`` (loading never unpickles code). Tensors: ``input_ids``,
``cu_seqlens``, ``pixels.{i}``, ``features.{i}`` (``i``: the item's index in the caller's order).

SENSITIVE DATA: token ids are the sample's content (text decodes from them), and the pixels
of the mismatched items are saved by default (never raw text). Store bundles like training
data, not like logs (files are written mode 0600, atomically: :mod:`.bundle_save`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import GuardConfig
from ..core.alignment import AlignmentReport
from ..core.grammar import Grammar
from ..core.items import MediaItem
from ..diagnostics import RankInfo
from ..errors import MediaGuardError, MediaInputError
from .bundle_limits import (
    LimitError,
    check_loaded,
    check_meta,
    check_safetensors,
    check_torch_zip,
    max_bytes_from_env,
)

FORMAT = "media_guard.bundle"
SCHEMA_VERSION = 1
SUFFIX = ".bundle"
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_SAMPLES_IN_SUMMARY = 256


class BundleError(MediaInputError):
    """A bundle cannot be read: missing, corrupt, partial, or of an unknown schema."""


def _safetensors():
    """``safetensors.torch`` or None when the package is not installed."""
    try:
        import safetensors.torch as st
    except ImportError:
        return None
    return st


# ---- metadata <-> objects --------------------------------------------------------------
def _json_default(value: object) -> object:
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _plain(value: object) -> object:
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# the fields saved (an item's ``pixels`` are tensors; a grammar's ``text_id`` is not saved: a
# replay feeds no text)
_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(MediaItem) if f.name != "pixels")
_GRAMMAR_FIELDS = tuple(f.name for f in dataclasses.fields(Grammar) if f.name != "text_id")
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(GuardConfig))


def _fields_meta(obj: object, names: tuple[str, ...]) -> dict:
    """The fields ``names`` of ``obj`` as JSON data (tuples as lists, mappings as dicts); a
    value that is no JSON is left out (a config's callables)."""
    out = {}
    for k in names:
        v = getattr(obj, k)
        v = dict(v) if isinstance(v, Mapping) else _plain(v)
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(v)
            out[k] = v
    return out


def _build(cls: type, meta: Mapping, names: tuple[str, ...], **given: object):
    """``cls`` from the fields ``names`` found in ``meta`` (lists as tuples); a field absent in
    a bundle written before it existed takes its default."""
    return cls(**{k: _tuples(meta[k]) for k in names if k in meta}, **given)


# the facts kept of an alignment report and of each of its mismatched samples
_REPORT_FIELDS = ("ok", "num_runs", "num_items", "total_placeholders", "total_features", "orphans")
_SAMPLE_FIELDS = ("sample", "sample_id", "row", "status", "reason", "expected", "got", "items")
_SAMPLE_FIELDS += ("first_mismatch",)


def report_summary(report: AlignmentReport) -> dict:
    """The JSON-safe facts of an alignment report (counts, statuses, positions; no content)."""
    bad = report.mismatched
    return {
        **_fields_meta(report, _REPORT_FIELDS),
        "num_samples": len(report.samples),
        "stray_findings": [f.describe() for f in report.stray_findings[:16]],
        "num_mismatched": len(bad),
        "mismatched": [
            {**_fields_meta(r, _SAMPLE_FIELDS), "findings": [f.describe() for f in r.findings[:8]]}
            for r in bad[:_MAX_SAMPLES_IN_SUMMARY]
        ],
    }


def _tensor_meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy (safetensors refuses tensors that share storage)."""
    return t.detach().to("cpu", copy=True).contiguous()


# ---- reading ----------------------------------------------------------------------------
_META_ERRORS = (KeyError, TypeError, ValueError, AttributeError, RecursionError, MediaGuardError)


@dataclasses.dataclass(frozen=True, eq=False)
class Bundle:
    """A loaded bundle. ``items`` carry ``pixels`` where they were saved; ``features``
    maps an item's index to its saved ``[n_i, h]`` rows; ``report`` is the alignment
    summary at save time (see :func:`report_summary`); ``config`` None when not saved."""

    path: Path
    input_ids: torch.Tensor
    items: tuple[MediaItem, ...]
    grammar: Grammar
    cu_seqlens: torch.Tensor | None
    step: int | None
    microbatch: int | None
    rank: RankInfo | None
    config: GuardConfig | None
    features: Mapping[int, torch.Tensor]
    report: Mapping[str, object]
    log_path: str | None
    created: str | None
    schema: int = SCHEMA_VERSION


def _read_payload(path: Path, max_bytes: int) -> tuple[str, dict[str, torch.Tensor]]:
    """The metadata text and the tensors, each size checked against ``max_bytes`` before
    the payload is read (header / zip directory) and after (logical sizes)."""
    with open(path, "rb") as fh:
        head = fh.read(16)
    if head[:4] == _ZIP_MAGIC:
        check_torch_zip(path, max_bytes)
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(obj, dict) or not isinstance(obj.get(FORMAT), str):
            raise BundleError(f"{path} is a torch file but not a media-guard bundle")
        tensors = obj.get("tensors") or {}
        if not isinstance(tensors, dict):
            raise BundleError(f"{path}: 'tensors' is not a mapping of name -> tensor")
        check_loaded(tensors, max_bytes)
        return obj[FORMAT], dict(tensors)
    # a safetensors file opens with its header's length (8 bytes) and the header's JSON object:
    # any other file fails this at once (a length past the file is the limit check's to name)
    if len(head) < 9 or head[8:9] != b"{":
        raise BundleError(
            f"{path} is not a media-guard bundle: neither a torch zip nor a safetensors file "
            f"(it starts with {head[:16]!r})"
        )
    if _safetensors() is None:
        raise BundleError(
            f"{path} is a safetensors bundle; reading it needs the safetensors package "
            "(pip install safetensors)"
        )
    from safetensors import safe_open

    check_safetensors(path, max_bytes)
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        text = (fh.metadata() or {}).get(FORMAT)
        if text is None:
            raise BundleError(f"{path} is a safetensors file but not a media-guard bundle")
        return text, {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def _not_a_file(path: Path) -> str:
    if path.is_dir():
        found = sorted(p.name for p in path.glob("media_guard.rank*.bundle"))[:3]
        hint = (
            f" (it holds {', '.join(found)}, ...)"
            if found
            else " (it holds no media_guard.rank*.bundle file)"
        )
        return f"{path} is a directory: give one bundle file{hint}"
    if not path.exists():
        return f"no bundle file at {path} (no such file)"
    return f"{path} is not a regular file"


def load_bundle(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> Bundle:
    """Read and validate a bundle; raises :class:`BundleError` naming what is wrong.

    max_bytes: the most tensor data the bundle may declare, in all (default
    ``MEDIA_GUARD_REPLAY_MAX_BYTES`` or 1 GiB); checked before anything is allocated.
    """
    path = Path(path)
    try:
        limit = max_bytes_from_env() if max_bytes is None else int(max_bytes)
    except LimitError as err:
        raise BundleError(str(err)) from None
    if not path.is_file():  # follows a symlink; a FIFO or device is not a file
        raise BundleError(_not_a_file(path))
    try:
        text, tensors = _read_payload(path, limit)
    except BundleError:
        raise
    except Exception as err:  # over a limit, corrupt header, truncated data, refused pickle
        why = f"refused: {err}" if isinstance(err, LimitError) else f"{type(err).__name__}: {err}"
        raise BundleError(
            f"{path} is not a readable bundle ({why})", context={"path": str(path)}
        ) from None
    try:
        meta = json.loads(text)
        check_meta(meta)
        return _from_meta(path, meta, tensors)
    except BundleError:
        raise
    except _META_ERRORS as err:  # what building objects from hostile metadata can raise
        why = f": {err}" if isinstance(err, LimitError) else f" ({type(err).__name__}: {err})"
        raise BundleError(
            f"{path}: bundle metadata is invalid{why}", context={"path": str(path)}
        ) from None


def _from_meta(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> Bundle:
    if meta.get("format") != FORMAT:  # check_meta: a dict
        raise BundleError(f"{path}: not a {FORMAT} (format {meta.get('format')!r})")
    schema = meta.get("schema")
    if schema != SCHEMA_VERSION:
        raise BundleError(f"{path}: bundle schema {schema!r}, this media-guard reads schema 1")
    manifest = meta["tensors"]
    missing = sorted(set(manifest) - set(tensors))
    if missing or "input_ids" not in manifest:
        raise BundleError(f"{path}: partial bundle, tensors missing: {missing or ['input_ids']}")
    for name, spec in manifest.items():
        if _tensor_meta(tensors[name]) != spec:
            raise BundleError(
                f"{path}: tensor {name!r} is {_tensor_meta(tensors[name])}, metadata says {spec}"
            )
    items = tuple(
        _build(MediaItem, m, _ITEM_FIELDS, pixels=tensors.get(f"pixels.{i}"))
        for i, m in enumerate(meta["items"])
    )
    features = {int(k.split(".", 1)[1]): t for k, t in tensors.items() if k.startswith("features.")}
    rank = RankInfo(**meta["rank"]) if meta.get("rank") is not None else None
    config = meta.get("config")
    config = None if config is None else _build(GuardConfig, config, _CONFIG_FIELDS)
    return Bundle(
        path=path,
        input_ids=tensors["input_ids"],
        items=items,
        grammar=_build(Grammar, meta["grammar"], _GRAMMAR_FIELDS),
        cu_seqlens=tensors.get("cu_seqlens"),
        step=meta.get("step"),
        microbatch=meta.get("microbatch"),
        rank=rank,
        config=config,
        features=MappingProxyType(features),
        report=MappingProxyType(meta["report"]),
        log_path=meta.get("log_path"),
        created=meta.get("created"),
        schema=schema,
    )
