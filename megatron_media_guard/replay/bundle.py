"""Replay bundle file format: one failing micro-batch, saved (:mod:`.bundle_save`) and loaded
(:mod:`.bundle_load`) for ``media-guard replay`` (:mod:`.rerun`) to re-run the check without a
GPU, torch.distributed or the data pipeline. It holds the token ids, every :class:`MediaItem`
field but ``pixels``, the grammar, ``cu_seqlens``, the config's fields, rank, step,
microbatch, a summary of the alignment report and, optionally, the mismatched items' pixels
and features.

One file ``media_guard.rank{rank:05d}.step{step}.mb{microbatch}[.k].bundle`` (``k`` counts up
instead of overwriting): a safetensors file whose header metadata holds the JSON description
under ``"media_guard.bundle"``; without ``safetensors``, a ``torch.save`` zip of
``{"media_guard.bundle": json, "tensors": {name: tensor}}`` read back with
``torch.load(weights_only=True)`` (loading never unpickles code). Tensors: ``input_ids``,
``cu_seqlens``, ``pixels.{i}``, ``features.{i}`` (``i``: the item's index in the caller's order).

SENSITIVE DATA: token ids are the sample's content (text decodes from them), and the pixels
of the mismatched items are saved by default (never raw text). Store bundles like training
data, not like logs (files are written mode 0600). Writes are atomic (temp file, fsync, hard
link to a name not yet taken); an I/O failure is logged and ``save_bundle`` returns None,
never raising into the training step (bad arguments still raise).
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


# the fields saved (an item's ``pixels`` are tensors; a grammar's ``text_id`` is not saved: a
# replay feeds no text)
_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(MediaItem) if f.name != "pixels")
_GRAMMAR_FIELDS = ("placeholders", "start_id", "end_id", "break_ids", "collapsed", "name")
_GRAMMAR_FIELDS += ("regions", "inner", "aliases")
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
