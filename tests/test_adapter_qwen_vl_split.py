"""A Qwen3-VL video whose temporal groups land in two samples: every run has the length its
grid row says and the batch totals agree, but the groups of one video (one grid row) feed the
runs of two samples, so one sample would train on frames of the other's video. The pre-hook
finds it on the device (an item's runs must lie in one sample) and never keeps or repairs it.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_adapter_qwen_vl_checks import _check, _report

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.core.runs import TokenLayout
from megatron_media_guard.geometry import PatchMergeGeometry

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


def _clips(frames: tuple[int, int]) -> dict:
    from megatron_media_guard.testing.qwen_vl import Sample, build_batch, smooth_clip

    samples = [
        Sample((("video", smooth_clip(n, 96, 96, seed)),)) for n, seed in zip(frames, (1, 5))
    ]
    return build_batch(samples, "qwen3_vl", 16, 12 * 32 * 32)


def _batch() -> dict:
    """The engine sampled 4 frames of each clip (2 groups each); the trainer 6 of the first and
    2 of the second: the same 4 groups of the same size, grouped 3 + 1."""
    pytest.importorskip("transformers.models.qwen3_vl")
    pytest.importorskip("PIL")
    mixed, trainer = _clips((4, 4)), _clips((6, 2))
    mixed.update(pixel_values_videos=trainer["pixel_values_videos"])
    mixed.update(video_grid_thw=trainer["video_grid_thw"])
    return mixed


_MODEL: list = []


def _model():
    from megatron_media_guard.testing.qwen_vl import tiny_model

    if not _MODEL:
        _MODEL.append(tiny_model("qwen3_vl"))
    return _MODEL[0]


def _guard(policy: str, tmp_path) -> MediaGuard:
    f = 16 * 2
    geo = PatchMergeGeometry(patch=16, merge=2, min_pixels=f * f, max_pixels=30 * f * f)
    return MediaGuard(
        GuardConfig(policy=policy, fallback="drop", log_dir=str(tmp_path)),
        grammar=G,
        geometry={"image": geo, "video": geo},
    )


def test_real_qwen3_vl_trains_silently_on_the_split_video(tmp_path):
    from megatron_media_guard.adapters import install_qwen_vl

    mixed = _batch()
    assert mixed["video_grid_thw"][:, 0].tolist() == [3, 1]
    with torch.no_grad():
        _model()(**mixed)  # the plain model: no error at all
    for policy in ("repair", "drop"):
        with torch.no_grad(), install_qwen_vl(_model(), _guard(policy, str(tmp_path))) as h:
            _model()(**mixed)
        assert h.last_result.report.actions == ("drop", "drop"), policy


def test_raise_names_the_split_row(tmp_path):
    from megatron_media_guard.adapters import install_qwen_vl

    mixed = _batch()
    with (
        install_qwen_vl(_model(), _guard("raise", tmp_path)),
        pytest.raises(MediaAlignmentError) as err,
    ):
        _model()(**mixed)
    thw = mixed["video_grid_thw"][0].tolist()
    msg = str(err.value)  # both samples, with the video's grid
    assert "sample 0" in msg and "sample 1" in msg and f"grid {'x'.join(map(str, thw))}" in msg
    recs = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    raised = [r for r in recs if r["event"] == "raise"]
    assert [r["sample"] for r in raised] == [0, 1]
    split = [r for r in recs if r["event"] == "check" and r["action"] == "split"]
    assert [r["reason"] for r in split] == [
        f"video 0 grid {tuple(thw)}: its runs fall in samples [0, 1]"
    ]


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
