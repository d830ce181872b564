"""A Qwen3-VL video whose temporal groups land in two samples: every run has the length its
grid row says and the batch totals agree, but the groups of one video (one grid row) feed the
runs of two samples, so one sample would train on frames of the other's video. The pre-hook
finds it on the device (an item's runs must lie in one sample) and never keeps or repairs it
(on the real Qwen3-VL: tests/test_adapter_qwen_vl.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_adapter_qwen_vl_checks import _check, _report

from megatron_media_guard import Grammar
from megatron_media_guard.core.runs import TokenLayout

G = Grammar.qwen2_vl()
VID, START, END, TEXT = G.placeholders["video"], G.start_id, G.end_id, 7


def _ids(groups_per_sample: list[int], packed: bool, cells: int = 4):
    group = [TEXT, START, *[VID] * cells, END]
    rows = [[TEXT, *group * n, TEXT] for n in groups_per_sample]
    if packed:  # one THD row, samples at cu_seqlens
        cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
        return torch.tensor([[t for r in rows for t in r]]), cu
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows]), None


@pytest.mark.parametrize(
    ("tokens", "grid_t", "split"),
    [
        ([2, 2], [2, 2], False),  # each video in its sample
        ([2, 2], [3, 1], True),  # video 0's third group fed to sample 1's first run
        ([1, 3], [2, 2], True),
        ([3, 0], [1, 2], False),  # two videos in sample 0: no row crosses a sample
        ([1, 0, 1], [2], True),  # across an empty sample
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_a_video_row_across_two_samples_is_not_aligned(tokens, grid_t, split, packed):
    ids, cu = _ids(tokens, packed)
    grids = {"image": None, "video": torch.tensor([[t, 4, 4] for t in grid_t])}
    lay = TokenLayout(ids, G, cu)
    verdict, _ = _check(lay, ids, grids, per_group=True)
    report, found = _report(lay, ids, grids, per_group=True)
    assert report.ok  # each run is fed the length it holds: only the rows give it away
    assert (verdict.bad_runs == 0) == (not split)
    assert bool(found) == split


@settings(max_examples=60, deadline=None)
@given(
    ts=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    pick=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    packed=st.booleans(),
)
def test_any_group_moved_between_samples_is_found(ts, pick, packed):
    """One video per sample, all of one frame size; the grids move one temporal group from
    video ``j`` to an earlier video ``i``: every run still counts right, the rows do not."""
    i, j = sorted(p % len(ts) for p in pick)
    grid_t = list(ts)
    moved = i < j and ts[j] > 1
    if moved:
        grid_t[i] += 1
        grid_t[j] -= 1
    ids, cu = _ids(ts, packed)
    grids = {"image": None, "video": torch.tensor([[t, 4, 4] for t in grid_t])}
    lay = TokenLayout(ids, G, cu)
    verdict, _ = _check(lay, ids, grids, per_group=True)
    _, found = _report(lay, ids, grids, per_group=True)
    assert (verdict.bad_runs == 0) == (not moved)
    assert bool(found) == moved
