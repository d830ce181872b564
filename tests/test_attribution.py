"""Errors that say their cause: NaN/Inf raises and records name ``nonfinite``, the item and
the sample_id; labels that cannot hold ``ignore_index`` are refused; nothing in building
the message can replace the alignment error."""

from __future__ import annotations

import pytest
import torch
from family_checks import records

from megatron_media_guard import (
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.core import explain
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.testing import TEST_GRAMMARS, inject

Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4)], [("image", 3), ("image", 2)]]


pytestmark = pytest.mark.usefixtures("quiet_logger")


def _batch_with_nan(item: int):
    batch = inject(Q, LAYOUT, "none")
    items = [
        MediaItem(it.num_features, sample=it.sample, sample_id=f"id-{i}")
        for i, it in enumerate(batch.items)
    ]
    feats = batch.features(8)
    start = sum(it.num_features for it in items[:item])
    feats[start + 1, 3] = float("nan")
    return batch, items, feats


@pytest.mark.parametrize("item, sample, sid", [(0, 0, "id-0"), (2, 1, "id-1")])
@pytest.mark.parametrize("nonfinite", ["raise", "drop"])
def test_nonfinite_names_cause_item_and_sample_id(tmp_path, item, sample, sid, nonfinite):
    batch, items, feats = _batch_with_nan(item)
    cfg = GuardConfig(log_dir=str(tmp_path), nonfinite=nonfinite)
    guard = MediaGuard(cfg, Q, rank=RankInfo(rank=0))
    emb = torch.zeros(*batch.input_ids.shape, 8)
    if nonfinite == "drop":
        assert guard.merge(emb, batch.input_ids, feats, items).report.dropped == (sample,)
    else:
        with pytest.raises(MediaAlignmentError) as info:
            guard.merge(emb, batch.input_ids, feats, items, step=2)
        msg = str(info.value)
        assert f"nonfinite: NaN/Inf in the features of item {item}" in msg
        assert f"sample {sample} (sample_id {sid!r})" in msg  # the sample's id: its first item's
        assert "aligned — ." not in msg
    (rec,) = records(tmp_path)
    assert rec["event"] == nonfinite and rec["reason"].startswith("nonfinite")
    assert (rec["sample"], rec["item"]) == (sample, item)
    assert rec["sample_id"] == sid and rec["extra"]["items"] == [item]


CANNOT_HOLD = "cannot hold ignore_index -100"


@pytest.mark.parametrize(
    "labels, refused",
    [
        (torch.int64, None),
        (torch.int32, None),
        (torch.int16, None),
        (torch.int8, None),  # -100 fits
        (torch.uint8, CANNOT_HOLD),  # -100 would wrap to 156
        (torch.bool, CANNOT_HOLD),
        # the library's error on both stages (not an AttributeError from deep inside)
        (torch.float32, "labels must be integer"),
        ("shape", r"labels must be \[b, s\]"),
        ("list", r"labels must be \[b, s\]"),
    ],
)
@pytest.mark.parametrize("path", ["merge", "last_stage"])
def test_labels_the_guard_cannot_mask_are_refused_by_both_stages(labels, refused, path):
    batch = inject(Q, LAYOUT, "surplus_feature")
    guard = MediaGuard(GuardConfig(policy="drop"), Q, rank=RankInfo(rank=0))
    if labels == "shape":
        labels = torch.ones(2, 3, dtype=torch.int64)
    elif labels == "list":
        labels = [[1, 2, 3]]
    else:
        labels = torch.ones(batch.input_ids.shape, dtype=labels)
    emb = torch.zeros(*batch.input_ids.shape, 8)

    def call():
        if path == "merge":
            return guard.merge(emb, batch.input_ids, batch.features(8), batch.items, labels=labels)
        return guard.last_stage(batch.input_ids, batch.items, labels=labels)

    if refused is None:
        res = call()
        assert (res.labels == -100).any() and res.labels.dtype == labels.dtype
    else:
        with pytest.raises(MediaInputError, match=refused):
            call()


def test_message_building_cannot_hide_the_alignment_error(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("a field that cannot be printed")

    monkeypatch.setattr(explain, "summary_line", broken)
    batch = inject(Q, LAYOUT, "surplus_feature")
    guard = MediaGuard(GuardConfig(log_dir=str(tmp_path)), Q, rank=RankInfo(rank=4))
    emb = torch.zeros(*batch.input_ids.shape, 8)
    with pytest.raises(MediaAlignmentError) as info:
        guard.merge(emb, batch.input_ids, batch.features(8), batch.items, step=9)
    msg = str(info.value)
    assert "Media alignment failed (rank 4, step 9)" in msg and "RuntimeError" in msg
    assert "per-rank log:" in msg
