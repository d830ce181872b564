"""Which item stream feeds each run when several modalities share one placeholder token
(Nemotron Omni's images and video tubelets both use ``<image>``): host-side, on run and item
lengths only, off the single-modality aligned path."""

from __future__ import annotations

from collections.abc import Sequence


def interleave(runs: Sequence[int], first: Sequence[int], second: Sequence[int]):
    """Stream (0: ``first``, 1: ``second``) of each run, keeping each stream's order, so that
    every run's length equals its item's.

    Returns ``(streams, unique)``: ``streams`` None when no interleaving fits (the guard then
    reports the mismatch); ``unique`` False when several fit (equal lengths at a choice: the
    same one is returned every time). O(runs x min(len)) states.
    """
    n, p, q = len(runs), len(first), len(second)
    if n != p + q:
        return None, False
    # ways[i]: interleavings of the first r runs using i items of ``first`` (capped at 2)
    ways = {0: 1}
    back: list[dict[int, int]] = []
    for r, length in enumerate(runs):
        nxt: dict[int, int] = {}
        came: dict[int, int] = {}
        for i, w in ways.items():
            j = r - i
            if i < p and first[i] == length:
                nxt[i + 1] = min(2, nxt.get(i + 1, 0) + w)
                came.setdefault(i + 1, 0)
            if j < q and second[j] == length:
                nxt[i] = min(2, nxt.get(i, 0) + w)
                came.setdefault(i, 1)
        if not nxt:
            return None, False
        ways = nxt
        back.append(came)
    if p not in ways:
        return None, False
    out = [0] * n
    i = p
    for r in range(n - 1, -1, -1):
        s = back[r][i]
        out[r] = s
        i -= 1 - s
    return out, ways[p] == 1
