"""Marker pairs nested right inside another pair's region (``Grammar.inner``), on the device.

Qwen3-Omni's ``<|vision_start|><|audio_start|>`` ... ``<|audio_end|><|vision_end|>``: the
nested markers are read as part of the outer region's (neither opens, closes nor is text);
what is checked is that they pair up. No sync in :func:`violations` (the aligned path's).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from .grammar import Grammar
from .parsed import FindingKind


class Nested(NamedTuple):
    """``[b, s]`` bool masks: nested starts, nested ends, either."""

    start: torch.Tensor
    end: torch.Tensor
    either: torch.Tensor


class NestingLayout(Protocol):
    """What this module reads of ``runs.TokenLayout`` (runs.py imports this module)."""

    grammar: Grammar
    row_length: int
    seg_start: torch.Tensor | None

    @property
    def nested(self) -> Nested | None: ...
    @property
    def is_end(self) -> torch.Tensor | None: ...
    def _any_of(self, toks: tuple[int, ...]) -> torch.Tensor | None: ...
    def prev(self, x: torch.Tensor, fill: bool | int = False) -> torch.Tensor: ...
    def next(self, x: torch.Tensor, fill: bool | int = False) -> torch.Tensor: ...


def markers(lay: NestingLayout) -> Nested:
    """Inner starts right after an outer start, inner ends right before an outer end."""
    g = lay.grammar
    start = lay._any_of(tuple(a for a, _ in g.inner)) & lay.prev(lay._any_of(g.outer_start_ids))
    end = lay._any_of(tuple(b for _, b in g.inner)) & lay.next(lay._any_of(g.outer_end_ids))
    return Nested(start, end, start | end)


def with_markers(lay: NestingLayout, x: torch.Tensor) -> torch.Tensor:
    """``x`` or a nested marker (those are no text: a run before ``<|audio_end|>`` is closed)."""
    return x if lay.nested is None else x | lay.nested.either


def violations(lay: NestingLayout) -> torch.Tensor | int:
    """Device scalar, no sync: 0 exactly when nested starts and ends pair up (their depth per
    sample stays in {0, 1} and is 0 at every region's end)."""
    if lay.nested is None:
        return 0
    i32 = torch.int32
    x = torch.cumsum(lay.nested.start, 1, dtype=i32) - torch.cumsum(lay.nested.end, 1, dtype=i32)
    if lay.seg_start is not None:
        first = lay.seg_start
        x = x - torch.where(first > 0, x.gather(1, (first - 1).clamp(min=0)), 0)
    return torch.count_nonzero((x < 0) | (x > 1) | (lay.is_end & (x != 0)))


def marks(
    lay: NestingLayout, inside: torch.Tensor, last_marker: torch.Tensor
) -> list[tuple[torch.Tensor, FindingKind]]:
    """The exact findings: a nested start never closed (unterminated), a nested end in a
    region opened without one. ``inside`` / ``last_marker``: per token, whether a region is
    open and the column of the last marker before it."""
    after = (last_marker + 1).clamp(max=lay.row_length - 1)
    opened = inside & lay.nested.start.gather(1, after)  # the open region began nested
    closes = lay.prev(lay.nested.end)
    return [
        (lay.is_end & opened & ~closes, FindingKind.UNTERMINATED),
        (lay.nested.end & ~opened, FindingKind.END_WITHOUT_START),
    ]
