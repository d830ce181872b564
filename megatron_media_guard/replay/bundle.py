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
from collections.abc import Mapping

import torch

from ..config import GuardConfig
from ..core.alignment import AlignmentReport
from ..core.grammar import Grammar
from ..core.items import MediaItem
from ..errors import MediaInputError

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


def _item_meta(item: MediaItem, pixels: dict | None) -> dict:
    meta = {f.name: _plain(getattr(item, f.name)) for f in dataclasses.fields(MediaItem)}
    meta["pixels"] = pixels
    return meta


_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(MediaItem) if f.name != "pixels")


def _item_from_meta(meta: Mapping, pixels: torch.Tensor | None) -> MediaItem:
    known = {k: _tuples(meta[k]) for k in _ITEM_FIELDS if k in meta}
    return MediaItem(**known, pixels=pixels)


# the grammar as saved (``text_id`` is not: a replay feeds no text)
_GRAMMAR_FIELDS = ("placeholders", "start_id", "end_id", "break_ids", "collapsed", "name")
_GRAMMAR_FIELDS += ("regions", "inner", "aliases")


def _grammar_meta(g: Grammar) -> dict:
    values = {k: getattr(g, k) for k in _GRAMMAR_FIELDS}
    return {k: dict(v) if isinstance(v, Mapping) else _plain(v) for k, v in values.items()}


def _grammar_from_meta(meta: Mapping) -> Grammar:
    """``regions``, ``inner`` and ``aliases`` are absent in bundles written before them."""
    return Grammar(**{k: _tuples(meta[k]) for k in _GRAMMAR_FIELDS if k in meta})


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
