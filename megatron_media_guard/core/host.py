"""The one place where the guard moves data from the device to the host: every transfer goes
through :func:`to_host` / :func:`scalars_to_host`, which count it by ``why`` (the reason the
host needs the values), so tests assert the aligned path syncs once. ``torch.nonzero`` on
CUDA syncs too; the guard uses it only off the aligned path."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_lock = threading.Lock()
_reasons: Counter[str] = Counter()


def to_host(tensor: torch.Tensor, why: str) -> torch.Tensor:
    """Copy ``tensor`` to CPU (a blocking sync when it lives on an accelerator; on CPU nothing
    moves, and the call is still counted: its call site is a sync)."""
    with _lock:
        _reasons[why] += 1
    return tensor.detach().to("cpu")


def scalars_to_host(
    parts: list[torch.Tensor], device: torch.device, why: str
) -> list[int | float | bool]:
    """The values of 0-d and 1-d tensors on ``device``, flattened, in one counted transfer (on
    CPU each read in place: a ``cat`` costs more than the reads there)."""
    with _lock:
        _reasons[why] += 1
    if device.type == "cpu":
        return [v for p in parts for v in (p.tolist() if p.dim() else (p.item(),))]
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    return flat.detach().to("cpu").tolist()


@contextmanager
def count_transfers() -> Iterator[Counter[str]]:
    """Counts the transfers made inside the block, by reason."""
    seen: Counter[str] = Counter()
    with _lock:
        before = Counter(_reasons)
    try:
        yield seen
    finally:
        with _lock:
            seen.update(_reasons - before)
