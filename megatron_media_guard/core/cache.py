"""The core's bounded caches: a training run repeats its grammars, items and shapes."""

from __future__ import annotations

import torch


def kept(store: dict, limit: int, key, make):
    """``store[key]``, made on a miss; the oldest entry goes past ``limit``. A key holding
    ``id(obj)`` keeps ``obj`` in its value: alive, its id names no other object."""
    got = store.get(key)
    if got is None:
        if len(store) >= limit:
            store.pop(next(iter(store)))
        got = store[key] = make()
    return got


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(values: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` (int64) on ``dev``, cached."""
    return kept(
        _CONSTANTS,
        32,
        (values, dev),
        lambda: torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True),
    )
