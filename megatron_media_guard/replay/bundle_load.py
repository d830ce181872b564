"""Reading a replay bundle (format: :mod:`.bundle`) without unpickling code."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import GuardConfig
from ..core.grammar import Grammar
from ..core.items import MediaItem
from ..diagnostics import RankInfo
from ..errors import MediaGuardError
from .bundle import (
    _CONFIG_FIELDS,
    _GRAMMAR_FIELDS,
    _ITEM_FIELDS,
    _ZIP_MAGIC,
    FORMAT,
    SCHEMA_VERSION,
    BundleError,
    _build,
    _safetensors,
    _tensor_meta,
)
from .bundle_limits import (
    DEFAULT_MAX_BYTES,
    LimitError,
    check_loaded,
    check_meta,
    check_safetensors,
    check_torch_zip,
    max_bytes_from_env,
)

_META_ERRORS = (KeyError, TypeError, ValueError, AttributeError, RecursionError, MediaGuardError)


@dataclass(frozen=True, eq=False)
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


def _read_payload(
    path: Path, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[str, dict[str, torch.Tensor]]:
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
    st = _safetensors()
    if st is None:
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
    except LimitError as err:
        raise BundleError(
            f"{path} is not a readable bundle (refused: {err})",
            context={"path": str(path)},
        ) from None
    except Exception as err:  # corrupt header, truncated data, refused pickle payload
        raise BundleError(
            f"{path} is not a readable bundle ({type(err).__name__}: {err})",
            context={"path": str(path)},
        ) from None
    try:
        meta = json.loads(text)
        check_meta(meta)
        return _from_meta(path, meta, tensors)
    except BundleError:
        raise
    except LimitError as err:
        raise BundleError(f"{path}: bundle metadata is invalid: {err}") from None
    except _META_ERRORS as err:  # what building objects from hostile metadata can raise
        raise BundleError(
            f"{path}: bundle metadata is invalid ({type(err).__name__}: {err})",
            context={"path": str(path)},
        ) from None


def _from_meta(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> Bundle:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
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
