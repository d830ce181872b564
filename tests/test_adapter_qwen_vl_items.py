"""``set_items`` on the Qwen-VL family (the ``inputs`` engine): one :class:`MediaItem` per grid
row, checked against the grids. Items whose count or modalities do not match the grid rows, or
that give samples for some items only, never take the device path and are named on the fault
path (``vlm_items.call_items``, the guard's item checks); a declared feature count is checked
on the device with the runs and, when it disagrees with its grid row, named on the fault path.
Real tiny transformers Qwen2.5-VL, aligned batch (image, video, image)."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.errors import MediaInputError

pytest.importorskip("transformers.models.qwen2_5_vl")
pytest.importorskip("PIL")

from megatron_media_guard.adapters import install_qwen_vl
from megatron_media_guard.testing.qwen_vl import (
    Sample,
    build_batch,
    smooth_clip,
    smooth_image,
    tiny_model,
)

SAMPLES = [
    Sample((("image", smooth_image(150, 200, 1)),)),
    Sample((("video", smooth_clip(4, 150, 180, 2)),)),
    Sample((("image", smooth_image(60, 84, 3)),)),
]


@pytest.fixture(scope="module")
def setup():
    batch = build_batch(SAMPLES, "qwen2_5_vl", 14, 30 * 28 * 28)
    rows = [("image", r) for r in batch["image_grid_thw"].tolist()]
    rows += [("video", r) for r in batch["video_grid_thw"].tolist()]
    items = [
        MediaItem(t * h * w // 4, sample=s, modality=m)
        for (m, (t, h, w)), s in zip(rows, (0, 2, 1))
    ]
    return tiny_model("qwen2_5_vl"), batch, items


def _edit(items, what):
    items = list(items)
    if what == "count":
        return items[:1]
    if what == "modality":
        items[0] = MediaItem(items[0].num_features, sample=0, modality="video")
    elif what == "some_samples":
        items[1] = MediaItem(items[1].num_features, modality="image")
    elif what == "features":
        items[0] = MediaItem(items[0].num_features + 1, sample=0, modality="image")
    return items


@pytest.mark.parametrize(
    "what, match",
    [
        ("count", r"set_items gave 1 items \{'image': 1\} for this call's \{'image': 2"),
        ("modality", r"set_items gave 3 items .* for this call's \{'image': 2, 'video': 1\}"),
        ("some_samples", r"sample for every item or for none"),
        ("features", r"item 0 is image with \d+ features; image grid row 0 \(1, \d+, \d+\)"),
    ],
)
def test_items_that_contradict_the_grids_are_input_errors(setup, what, match):
    model, batch, items = setup
    guard = MediaGuard(GuardConfig(policy="drop"), grammar=Grammar.qwen2_vl())
    with torch.no_grad(), install_qwen_vl(model, guard) as h:
        h.set_items(items)
        model(**batch)  # the items as the grids say: aligned
        assert h.last_result.report.ok
        h.set_items(_edit(items, what))
        with pytest.raises(MediaInputError, match=match):
            model(**batch)
