"""What every family's tests check the same way: the per-rank records a guarded call wrote,
and a raise that names the culprit sample (in the message and in a ``raise`` record)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_media_guard import MediaAlignmentError


def records(log_dir) -> list[dict]:
    """Every record of the per-rank JSONL logs under ``log_dir``."""
    return [
        json.loads(line)
        for f in Path(log_dir).glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]


def raised_samples(run: Callable[[], object], bad: int | set[int], log_dir) -> set[int]:
    """Runs ``run`` (a guarded call under ``policy="raise"`` logging to ``log_dir``), which
    must raise :class:`MediaAlignmentError` naming ``bad`` (its first sample, for a set);
    returns the samples of the ``raise`` records it wrote."""
    first = bad if isinstance(bad, int) else min(bad)
    with pytest.raises(MediaAlignmentError, match=rf"sample {first}\b"):
        run()
    return {r["sample"] for r in records(log_dir) if r["event"] == "raise"}
