"""install_vlm on transformers' real ``Kimi_K25ForConditionalGeneration`` (tiny random config,
CPU): images and time-pooled video chunks (one grid row and one run per chunk of <= 4 frames),
each on its own placeholder token between ``<|media_begin|>`` / ``<|media_end|>``.

Inputs from ``testing/families/kimi_k25.py`` (the processors import torchvision: patches and grids
from their arithmetic). Comparisons are on the final hidden states (the 163k-vocabulary logits
are their ``lm_head``): the forward runs with ``logits_to_keep=1`` and a hook on ``model.model``
keeps its ``last_hidden_state``. The fixture's layout first; the plain class under the faults:
``tests/test_fixture_plain.py``; the shared contract and Kimi's own faults: ``tests/families/``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import hidden_forward as forward

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.errors import MediaInputError

pytest.importorskip("transformers.models.kimi_k25")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.testing.families import kimi_k25 as F
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)


def img(h, w, tokens=None):
    return M("image", (h, w), tokens)


def vid(f, h, w, tokens=None):
    return M("video", (f, h, w), tokens)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def test_layout(model):
    batch = F.make_batch(model, [[img(4, 6), vid(9, 2, 4)], [img(2, 2)]])
    kw, cfg = batch.kwargs, model.config
    assert kw["pixel_values"].shape == (28, 3, 14, 14)
    assert kw["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]
    assert kw["pixel_values_videos"].shape == (72, 3, 14, 14)
    assert kw["video_grid_thw"].tolist() == [[4, 2, 4], [4, 2, 4], [1, 2, 4]]  # <= 4 frames
    assert batch.items == [(0, "image", 6), (1, "image", 1), (0, "video", 6)]
    assert batch.runs == [[("image", 6), ("video", 2), ("video", 2), ("video", 2)], [("image", 1)]]
    count = [int((kw["input_ids"][0] == t).sum()) for t in
             (cfg.vision_start_token_id, cfg.vision_end_token_id, F.MEDIA_CONTENT)]  # fmt: skip
    assert count == [4, 4, 4]
    with torch.no_grad():  # time pooling: one feature row per chunk position, not per frame
        feats = model.model.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"])
    assert [f.shape[0] for f in feats.pooler_output] == [2, 2, 2]


def guarded(model, samples, config=None, items=None):
    b = F.make_batch(model, samples)
    with install_vlm(model, config or GuardConfig()) as h:
        if items is not None:
            h.set_items(items)
        hidden, out = forward(model, b.kwargs)
        return b, hidden, out, h.last_result


def test_set_items_takes_one_item_per_chunk(model, tmp_path):
    """``num_chunks_per_video`` never reaches the model: a 6-frame video is two chunk items."""
    samples = [[vid(6, 4, 4)], [vid(2, 2, 2, tokens=3)]]
    one_per_video = [MediaItem(0, sample=s, modality="video") for s in (0, 1)]
    with pytest.raises(MediaInputError, match="set_items gave 2 items"):
        guarded(model, samples, items=one_per_video)
    chunks = [
        MediaItem(0, sample=s, modality="video", sample_id=sid)
        for s, sid in ((0, "a"), (0, "a"), (1, "b"))
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), items=chunks)
