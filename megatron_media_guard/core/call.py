"""One guarded merge call's inputs, validated (what the guard and its fault path read)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .items import Batch
from .runs import TokenLayout


@dataclass(frozen=True)
class Call:
    """``emb``: the ``[b, s, h]`` view."""

    emb: torch.Tensor | None  # None: the last pipeline stage (no features, no merge)
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    lay: TokenLayout
    batch: Batch
    loss_mask: torch.Tensor | None
    labels: torch.Tensor | None
    seq_first: bool
    step: int | None
    microbatch: int | None
    encoder: object | None
    repairs: Literal["assume", "attempt"] = "assume"  # without features (emb None): last_stage
    sample_ids: tuple | None = None  # per sample, the caller's id (items without one take it)
    #: the caller's checks of the whole call, run by the fault path only (see MediaGuard.merge)
    fault_checks: Callable[[], Sequence[str]] | None = None
