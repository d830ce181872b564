"""The core's bounded caches: a training run repeats its grammars, items and shapes."""

from __future__ import annotations


def kept(store: dict, limit: int, key, make):
    """``store[key]``, made on a miss; the oldest entry goes past ``limit``. A key holding
    ``id(obj)`` keeps ``obj`` in its value: alive, its id names no other object."""
    got = store.get(key)
    if got is None:
        if len(store) >= limit:
            store.pop(next(iter(store)))
        got = store[key] = make()
    return got
