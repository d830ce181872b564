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
from ..errors import MediaAlignmentError
from .bundle import (
    _ZIP_MAGIC,
    FORMAT,
    SCHEMA_VERSION,
    BundleError,
    _config_from_meta,
    _item_from_meta,
    _safetensors,
    _tensor_meta,
)


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


def _read_payload(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == _ZIP_MAGIC:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(obj, dict) or not isinstance(obj.get(FORMAT), str):
            raise BundleError(f"{path} is a torch file but not a media-guard bundle")
        return obj[FORMAT], dict(obj.get("tensors") or {})
    st = _safetensors()
    if st is None:
        raise BundleError(
            f"{path} is a safetensors bundle; reading it needs the safetensors package "
            "(pip install safetensors)"
        )
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as fh:
        text = (fh.metadata() or {}).get(FORMAT)
        if text is None:
            raise BundleError(f"{path} is a safetensors file but not a media-guard bundle")
        return text, {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read and validate a bundle; raises :class:`BundleError` naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"no bundle file at {path}")
    try:
        text, tensors = _read_payload(path)
    except BundleError:
        raise
    except Exception as err:  # corrupt header, truncated data, refused pickle payload
        raise BundleError(
            f"{path} is not a readable bundle ({type(err).__name__}: {err})",
            context={"path": str(path)},
        ) from None
    try:
        meta = json.loads(text)
        return _from_meta(path, meta, tensors)
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, MediaAlignmentError) as err:
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
        _item_from_meta(m, tensors.get(f"pixels.{i}")) for i, m in enumerate(meta["items"])
    )
    features = {int(k.split(".", 1)[1]): t for k, t in tensors.items() if k.startswith("features.")}
    g = meta["grammar"]
    grammar = Grammar(
        dict(g["placeholders"]),
        start_id=g["start_id"],
        end_id=g["end_id"],
        break_ids=tuple(g["break_ids"]),
        collapsed=g["collapsed"],
        name=g["name"],
    )
    rank = RankInfo(**meta["rank"]) if meta.get("rank") is not None else None
    config = _config_from_meta(meta["config"]) if meta.get("config") is not None else None
    return Bundle(
        path=path,
        input_ids=tensors["input_ids"],
        items=items,
        grammar=grammar,
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
