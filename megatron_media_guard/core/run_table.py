"""The placeholder runs of a layout as one device table (no transfer here): what the full
parse (:func:`~.runs.parse_layout`) and the run order of a mixed call
(:func:`~.interleave.token_order`) read back, each in one transfer."""

from __future__ import annotations

from typing import Protocol

import torch


class RunLayout(Protocol):
    """What the table reads of a layout (``runs.TokenLayout`` is one; runs.py imports this
    module, so the layout is described here rather than imported)."""

    @property
    def ph(self) -> torch.Tensor: ...
    @property
    def sample(self) -> torch.Tensor: ...
    def run_codes(self, run_start: torch.Tensor) -> torch.Tensor: ...


#: the table's columns
COLUMNS = ("row", "start", "last", "length", "code", "sample")


def run_table(lay: RunLayout, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``[runs, 6]`` int64 in token order (:data:`COLUMNS`): each run's row, first and last
    column, placeholder count (breaks excluded), modality code of its first token (-1: breaks
    only) and sample. ``start`` / ``end``: :meth:`TokenLayout.run_bounds`."""
    ph_cum = torch.cumsum(lay.ph, 1)
    # torch.nonzero sizes its output by the number of runs (a sync on CUDA); row-major
    # order, so starts and ends pair up
    st = torch.nonzero(start)
    en = torch.nonzero(end)
    sr, sc, ec = st[:, 0], st[:, 1], en[:, 1]
    lengths = ph_cum[sr, ec] - ph_cum[sr, sc] + lay.ph[sr, sc].to(ph_cum.dtype)
    first_code = lay.run_codes(start)[sr, sc]
    first_code = torch.where(lengths == 0, -1, first_code)  # breaks only: no modality
    return torch.stack([sr, sc, ec, lengths, first_code.long(), lay.sample[sr, sc]], dim=1)
