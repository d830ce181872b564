"""Which item stream feeds each run when two modalities share one placeholder token
(Nemotron Omni's images and video tubelets both use ``<image>``): host-side, on run and item
lengths only, off the single-modality aligned path."""

from __future__ import annotations

from collections.abc import Sequence


def interleave(
    runs: Sequence[int],
    first: Sequence[int],
    second: Sequence[int],
    *,
    groups: Sequence[int] | None = None,
    run_samples: Sequence[int] | None = None,
):
    """Stream (0: ``first``, 1: ``second``) of each run, keeping each stream's order, so that
    every run's length equals its item's.

    groups: per item of ``second``, the model-level item it belongs to (a video's tubelets):
        one group's items take consecutive runs of one sample (``run_samples``).
    Returns ``(streams, unique)``: ``streams`` None when no interleaving fits (the guard then
    reports the mismatch); ``unique`` False when several fit (equal lengths at an open choice;
    the same one is returned every time). O(runs x min(len)) states.
    """
    n, p, q = len(runs), len(first), len(second)
    if n != p + q:
        return None, False

    def may_take_second(j: int, r: int, last: int) -> bool:
        if groups is None or j == 0 or groups[j] != groups[j - 1]:
            return True  # a new group may start anywhere
        same = run_samples is None or run_samples[r] == run_samples[r - 1]
        return last == 1 and same  # its group's previous item took the run just before

    # state (i, last): i items of ``first`` used, the previous run took stream ``last``;
    # value: number of interleavings reaching it, capped at 2
    ways: dict[tuple[int, int], int] = {(0, -1): 1}
    back: list[dict[tuple[int, int], tuple[int, int]]] = []
    for r, length in enumerate(runs):
        nxt: dict[tuple[int, int], int] = {}
        came: dict[tuple[int, int], tuple[int, int]] = {}
        for (i, last), w in sorted(ways.items()):
            j = r - i
            if i < p and first[i] == length:
                key = (i + 1, 0)
                nxt[key] = min(2, nxt.get(key, 0) + w)
                came.setdefault(key, (i, last))
            if j < q and second[j] == length and may_take_second(j, r, last):
                key = (i, 1)
                nxt[key] = min(2, nxt.get(key, 0) + w)
                came.setdefault(key, (i, last))
        if not nxt:
            return None, False
        ways = nxt
        back.append(came)
    ends = [(k, w) for k, w in sorted(ways.items()) if k[0] == p]
    if not ends:
        return None, False
    total = min(2, sum(w for _, w in ends))
    out = [0] * n
    state = ends[0][0]
    for r in range(n - 1, -1, -1):
        out[r] = state[1]
        state = back[r][state]
    return out, total == 1
