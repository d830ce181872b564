"""Writing a replay bundle (format: :mod:`.bundle`): atomic (temp file, fsync, hard link to a
name not yet taken), mode 0600, never raising an I/O error into the training step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import GuardConfig
from ..core.alignment import AlignmentReport, check_alignment
from ..core.grammar import Grammar
from ..core.items import MediaItem, normalize
from ..core.providers import provide_bundle_writer
from ..core.runs import TokenLayout
from ..diagnostics import RankInfo, file_name, get_logger, utc_now
from ..errors import MediaInputError
from .bundle import (
    _CONFIG_FIELDS,
    _GRAMMAR_FIELDS,
    _ITEM_FIELDS,
    FORMAT,
    SCHEMA_VERSION,
    SUFFIX,
    _cpu,
    _fields_meta,
    _json_default,
    _safetensors,
    _tensor_meta,
    report_summary,
)


def _check_args(input_ids, items, grammar, cu_seqlens, config, rank, step, microbatch, report):
    """The types; the ids' and ``cu_seqlens``' shapes and dtypes are TokenLayout's to check."""
    bad = [i for i, it in enumerate(items) if not isinstance(it, MediaItem)]
    if bad:
        raise MediaInputError(f"items must be MediaItem, item {bad[0]} is {type(items[bad[0]])}")
    typed = (("input_ids", input_ids, torch.Tensor), ("cu_seqlens", cu_seqlens, torch.Tensor))
    typed += (("grammar", grammar, Grammar), ("config", config, GuardConfig))
    typed += (("rank", rank, RankInfo), ("report", report, AlignmentReport))
    for name, v, cls in typed:
        if (v is not None or name in ("input_ids", "grammar")) and not isinstance(v, cls):
            raise MediaInputError(f"{name} must be a {cls.__name__}, got {type(v).__name__}")
    for name, v in (("step", step), ("microbatch", microbatch)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise MediaInputError(f"{name} must be an int >= 0 or None, got {v!r}")


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
    lay = TokenLayout(ids, grammar, cu)  # refuses ids or offsets no replay could read
    if report is None:
        report = check_alignment(ids, items, grammar, cu)
    elif report.num_items != len(items):
        raise MediaInputError(f"report covers {report.num_items} items, {len(items)} given")
    bad_items = sorted({i for r in report.mismatched for i in r.items} | set(report.orphans))
    tensors: dict[str, torch.Tensor] = {"input_ids": ids}
    if cu is not None:
        tensors["cu_seqlens"] = cu
    item_meta = []
    for i, it in enumerate(items):
        pix = None
        if isinstance(it.pixels, torch.Tensor):
            saved = include_pixels and i in bad_items
            pix = {**_tensor_meta(it.pixels), "saved": saved}
            if saved:
                tensors[f"pixels.{i}"] = _cpu(it.pixels)
        item_meta.append({**_fields_meta(it, _ITEM_FIELDS), "pixels": pix})
    if features is not None:  # checked as the merge checks them
        batch = normalize(features, items, lay.num_samples)
        tensors.update(
            {f"features.{i}": _cpu(batch.features[slice(*batch.rows(i))]) for i in bad_items}
        )
    r = rank or RankInfo()
    log_dir = config.log_dir if config is not None else None
    log_path = str(Path(log_dir) / file_name(r.rank)) if log_dir is not None else None
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
        "grammar": _fields_meta(grammar, _GRAMMAR_FIELDS),
        "config": _fields_meta(config, _CONFIG_FIELDS) if config is not None else None,
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


# the guard's fault path writes its bundles with this (core/providers.py: the core never
# imports replay/)
provide_bundle_writer(save_bundle)
