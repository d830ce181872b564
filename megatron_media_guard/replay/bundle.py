"""Replay bundle file format: one failing micro-batch saved to disk, loaded and validated.

On a mismatch the guard can save what it needs to re-run the check without a GPU,
without torch.distributed and without the data pipeline: the token ids, every
:class:`MediaItem` field except ``pixels`` (so each item's feature row count), the
grammar, ``cu_seqlens``, the config's policy fields, rank, step, microbatch and a
summary of the alignment report; optionally the pixel tensors and the features of the
mismatched items. :mod:`.replay` (``media-guard replay BUNDLE``) rebuilds the live
diagnostic from it.

Format: one file ``media_guard.rank{rank:05d}.step{step}.mb{microbatch}[.k].bundle``
(``k`` counts up instead of overwriting). It is a safetensors file whose header
metadata holds the JSON description under ``"media_guard.bundle"``; without the
``safetensors`` package it is a ``torch.save`` zip of ``{"media_guard.bundle": json,
"tensors": {name: tensor}}`` read back with ``torch.load(weights_only=True)``. Loading
never unpickles code. Tensor names: ``input_ids``, ``cu_seqlens``, ``pixels.{i}``,
``features.{i}`` (``i``: the item's index in the caller's order).

SENSITIVE DATA: a bundle holds token ids, which are the sample's content (text decodes
from them), and by default the pixels of the mismatched items. It never holds raw text.
Store bundles like training data, not like logs (files are written mode 0600).

Writes are atomic (temp file, fsync, hard link to a name not yet taken): a crash leaves
no half bundle under a ``.bundle`` name. An I/O failure is logged and ``save_bundle``
returns None, so it never raises into the training step; bad arguments still raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import GuardConfig
from ..core.alignment import AlignmentReport, align
from ..core.grammar import Grammar
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..diagnostics import RankInfo, file_name, get_logger, utc_now
from ..errors import MediaAlignmentError, MediaInputError

FORMAT = "media_guard.bundle"
SCHEMA_VERSION = 1
SUFFIX = ".bundle"
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_SAMPLES_IN_SUMMARY = 256


class BundleError(MediaAlignmentError):
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


def _item_meta(item: MediaItem, pixels: dict | None) -> dict:
    meta = {f.name: _plain(getattr(item, f.name)) for f in dataclasses.fields(MediaItem)}
    meta["pixels"] = pixels
    return meta


_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(MediaItem) if f.name != "pixels")


def _item_from_meta(meta: Mapping, pixels: torch.Tensor | None) -> MediaItem:
    known = {k: _tuples(meta[k]) for k in _ITEM_FIELDS if k in meta}
    return MediaItem(**known, pixels=pixels)


def _grammar_meta(g: Grammar) -> dict:
    return {
        "placeholders": dict(g.placeholders),
        "start_id": g.start_id,
        "end_id": g.end_id,
        "break_ids": list(g.break_ids),
        "collapsed": g.collapsed,
        "name": g.name,
    }


def _config_meta(config: GuardConfig) -> dict:
    out = {}
    for f in dataclasses.fields(config):
        value = _plain(getattr(config, f.name))
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(value)
            out[f.name] = value
    return out


def _config_from_meta(meta: Mapping) -> GuardConfig:
    names = {f.name for f in dataclasses.fields(GuardConfig)}
    return GuardConfig(**{k: _tuples(v) for k, v in meta.items() if k in names})


def report_summary(report: AlignmentReport) -> dict:
    """The JSON-safe facts of an alignment report (counts, statuses, positions; no content)."""
    bad = report.mismatched
    return {
        "ok": report.ok,
        "num_samples": len(report.samples),
        "num_runs": report.num_runs,
        "num_items": report.num_items,
        "total_placeholders": report.total_placeholders,
        "total_features": report.total_features,
        "orphans": list(report.orphans),
        "stray_findings": [f.describe() for f in report.stray_findings[:16]],
        "num_mismatched": len(bad),
        "mismatched": [
            {
                "sample": r.sample,
                "sample_id": r.sample_id,
                "row": r.row,
                "status": str(r.status),
                "reason": r.reason,
                "expected": list(r.expected),
                "got": list(r.got),
                "items": list(r.items),
                "first_mismatch": r.first_mismatch,
                "findings": [f.describe() for f in r.findings[:8]],
            }
            for r in bad[:_MAX_SAMPLES_IN_SUMMARY]
        ],
    }


def _tensor_meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy (safetensors refuses tensors that share storage)."""
    return t.detach().to("cpu", copy=True).contiguous()


# ---- save --------------------------------------------------------------------------------


def _check_args(input_ids, items, grammar, cu_seqlens, config, rank, step, microbatch, report):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        raise MediaInputError(f"input_ids must be a [b, s] tensor, got {_shape_or_type(input_ids)}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise MediaInputError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    bad = [i for i, it in enumerate(items) if not isinstance(it, MediaItem)]
    if bad:
        raise MediaInputError(f"items must be MediaItem, item {bad[0]} is {type(items[bad[0]])}")
    if not isinstance(grammar, Grammar):
        raise MediaInputError(f"grammar must be a Grammar, got {type(grammar).__name__}")
    if cu_seqlens is not None and (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.is_floating_point()
    ):
        raise MediaInputError(
            f"cu_seqlens must be a 1-D integer tensor, got {_shape_or_type(cu_seqlens)}"
        )
    if config is not None and not isinstance(config, GuardConfig):
        raise MediaInputError(f"config must be a GuardConfig, got {type(config).__name__}")
    if rank is not None and not isinstance(rank, RankInfo):
        raise MediaInputError(f"rank must be a RankInfo, got {type(rank).__name__}")
    for name, v in (("step", step), ("microbatch", microbatch)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise MediaInputError(f"{name} must be an int >= 0 or None, got {v!r}")
    if report is not None and not isinstance(report, AlignmentReport):
        raise MediaInputError(f"report must be an AlignmentReport, got {type(report).__name__}")


def _shape_or_type(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _feature_rows(features, items: Sequence[MediaItem]) -> list[torch.Tensor]:
    """Per-item ``[n_i, h]`` views of ``features`` (``[sum n_i, h]`` or a list)."""
    if isinstance(features, torch.Tensor):
        total = sum(it.num_features for it in items)
        if features.dim() != 2 or features.shape[0] != total:
            raise MediaInputError(
                f"features must be [{total}, hidden] for these items, got {tuple(features.shape)}"
            )
        return list(features.split([it.num_features for it in items]))
    parts = list(features)
    if len(parts) != len(items) or not all(isinstance(p, torch.Tensor) for p in parts):
        raise MediaInputError(f"features must be {len(items)} tensors, one per item")
    return parts


def bundle_name(rank: int | None, step: int | None, microbatch: int | None, k: int = 0) -> str:
    """``media_guard.rank00003.step12.mb0.bundle``; ``k > 0`` adds ``.k`` before the suffix."""
    stem = file_name(rank).removesuffix(".jsonl")
    stem += f".step{'na' if step is None else step}.mb{'na' if microbatch is None else microbatch}"
    return f"{stem}{f'.{k}' if k else ''}{SUFFIX}"


def save_bundle(
    dump_dir: str | os.PathLike[str],
    *,
    input_ids: torch.Tensor,
    items: Sequence[MediaItem],
    grammar: Grammar,
    cu_seqlens: torch.Tensor | None = None,
    config: GuardConfig | None = None,
    rank: RankInfo | None = None,
    step: int | None = None,
    microbatch: int | None = None,
    report: AlignmentReport | None = None,
    include_pixels: bool = True,
    features: torch.Tensor | Sequence[torch.Tensor] | None = None,
    max_bundles: int | None = None,
) -> Path | None:
    """Save one micro-batch as a replay bundle in ``dump_dir``; returns its path.

    input_ids: ``[b, s]`` (``[1, T]`` with ``cu_seqlens`` ``[n+1]``); items in feature order.
    report: the live alignment report (recomputed on a CPU copy of the ids when None).
    include_pixels: save ``pixels`` of the items of mismatched samples (and orphans).
    features: ``[sum n_i, h]`` or per-item ``[n_i, h]``; the mismatched items' rows are saved.
    max_bundles: save nothing (return None) when this rank already has that many in dump_dir.
    Returns None, after logging, when the bundle cannot be written (I/O); raises
    :class:`MediaInputError` for bad arguments.
    """
    items = tuple(items)
    _check_args(input_ids, items, grammar, cu_seqlens, config, rank, step, microbatch, report)
    ids = _cpu(input_ids)
    cu = _cpu(cu_seqlens) if cu_seqlens is not None else None
    if report is None:
        report = align(parse_layout(TokenLayout(ids, grammar, cu)), items)
    elif report.num_items != len(items):
        raise MediaInputError(f"report covers {report.num_items} items, {len(items)} given")
    bad_items = sorted({i for r in report.mismatched for i in r.items} | set(report.orphans))
    tensors: dict[str, torch.Tensor] = {"input_ids": ids}
    if cu is not None:
        tensors["cu_seqlens"] = cu
    rows = _feature_rows(features, items) if features is not None else None
    item_meta = []
    for i, it in enumerate(items):
        pix = None
        if isinstance(it.pixels, torch.Tensor):
            saved = include_pixels and i in bad_items
            pix = {**_tensor_meta(it.pixels), "saved": saved}
            if saved:
                tensors[f"pixels.{i}"] = _cpu(it.pixels)
        item_meta.append(_item_meta(it, pix))
    if rows is not None:
        for i in bad_items:
            tensors[f"features.{i}"] = _cpu(rows[i])
    r = rank or RankInfo()
    log_path = None
    if config is not None and config.log_dir is not None:
        log_path = str(Path(config.log_dir) / file_name(r.rank))
    meta = {
        "format": FORMAT,
        "schema": SCHEMA_VERSION,
        "created": utc_now(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "contents": "token ids and item metadata; pixels/features named in 'tensors' (sensitive)",
        "rank": dataclasses.asdict(rank) if rank is not None else None,
        "step": step,
        "microbatch": microbatch,
        "grammar": _grammar_meta(grammar),
        "config": _config_meta(config) if config is not None else None,
        "log_path": log_path,
        "items": item_meta,
        "report": report_summary(report),
        "tensors": {k: _tensor_meta(t) for k, t in tensors.items()},
    }
    try:
        text = json.dumps(meta, default=_json_default, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise MediaInputError(f"bundle metadata is not JSON-safe: {err}") from None
    try:
        return _write_atomic(Path(dump_dir), r.rank, step, microbatch, text, tensors, max_bundles)
    except (OSError, _safetensor_error()) as err:
        get_logger().error("[media-guard] cannot save replay bundle in %s: %s", dump_dir, err)
        return None


def _safetensor_error() -> type[BaseException]:
    try:
        from safetensors import SafetensorError
    except ImportError:
        return OSError
    return SafetensorError


def _write_atomic(dump_dir, rank, step, microbatch, text, tensors, max_bundles) -> Path | None:
    dump_dir.mkdir(parents=True, exist_ok=True)
    if max_bundles is not None:
        prefix = file_name(rank).removesuffix(".jsonl") + "."
        have = sum(1 for _ in dump_dir.glob(f"{prefix}*{SUFFIX}"))
        if have >= max_bundles:
            get_logger().warning(
                "[media-guard] %d replay bundles for this rank in %s already; not saving more",
                have,
                dump_dir,
            )
            return None
    tmp = dump_dir / f".{bundle_name(rank, step, microbatch)}.{uuid.uuid4().hex}.tmp"
    try:
        _write_payload(tmp, text, tensors)
        os.chmod(tmp, 0o600)  # owner-only, like the training data it holds
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        for k in range(100_000):
            final = dump_dir / bundle_name(rank, step, microbatch, k)
            if _publish(tmp, final):
                _fsync_dir(dump_dir)
                get_logger().warning("[media-guard] saved replay bundle %s", final)
                return final
        raise FileExistsError(f"no free bundle name for {final} in {dump_dir}")
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _write_payload(tmp: Path, text: str, tensors: dict[str, torch.Tensor]) -> None:
    st = _safetensors()
    if st is not None:
        st.save_file(tensors, str(tmp), metadata={FORMAT: text})
    else:
        torch.save({FORMAT: text, "tensors": tensors}, tmp)


def _publish(tmp: Path, final: Path) -> bool:
    """Give ``tmp`` the name ``final`` unless taken; True when done."""
    try:
        os.link(tmp, final)  # atomic and never overwrites
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem: check, then rename
        if final.exists():
            return False
        os.replace(tmp, final)
        return True


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- load ----------------------------------------------------------------------------------


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
