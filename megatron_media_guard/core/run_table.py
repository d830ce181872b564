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


def run_table(
    lay: RunLayout, start: torch.Tensor, end: torch.Tensor, size: int | None = None
) -> torch.Tensor:
    """``[runs, 6]`` int64 in token order (:data:`COLUMNS`): each run's row, first and last
    column, placeholder count (breaks excluded), modality code of its first token (-1: breaks
    only) and sample. ``start`` / ``end``: :meth:`TokenLayout.run_bounds`. ``size``: the
    table's rows fixed in advance (no sync: the first ``size`` runs, rows past the last run
    filled from position (0, 0), meaningless), for a caller that reads it with other values."""
    ph_cum = torch.cumsum(lay.ph, 1)
    # torch.nonzero sizes its output by the number of runs (a sync on CUDA; nonzero_static
    # with a size known on the host does not); row-major order, so starts and ends pair up
    if size is None:
        st = torch.nonzero(start)
        en = torch.nonzero(end)
    else:
        st = torch.nonzero_static(start, size=size, fill_value=0)
        en = torch.nonzero_static(end, size=size, fill_value=0)
    sr, sc, ec = st[:, 0], st[:, 1], en[:, 1]
    lengths = ph_cum[sr, ec] - ph_cum[sr, sc] + lay.ph[sr, sc].to(ph_cum.dtype)
    first_code = lay.run_codes(start)[sr, sc]
    first_code = torch.where(lengths == 0, -1, first_code)  # breaks only: no modality
    return torch.stack([sr, sc, ec, lengths, first_code.long(), lay.sample[sr, sc]], dim=1)
