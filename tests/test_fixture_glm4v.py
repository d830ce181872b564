"""GLM-4V fixture: aligned batches equal per-sample forwards; the unguarded faults, measured and pinned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_media_guard.testing.families import glm4v as fam
from megatron_media_guard.testing.families.base import Media

pytest.importorskip("transformers")


def img(h, w, tokens=None):
    return Media("image", (h, w), tokens)


def vid(t, h, w, tokens=None):
    return Media("video", (t, h, w), tokens)


@pytest.fixture(scope="module")
def model():
    return fam.tiny_model(seed=0)


def logits(model, batch):
    with torch.no_grad():
        return model(**batch.kwargs).logits


def own(model, sample):
    """The sample's logits in a batch of its own."""
    return logits(model, fam.make_batch(model, [sample]))[0]


ALIGNED = {
    "images": [[img(4, 6)], [img(8, 4), img(2, 2)]],
    "videos": [[vid(2, 4, 4)], [vid(3, 2, 4)]],
    "image+video in one sample": [[vid(2, 2, 4)], [img(4, 4), img(2, 2)]],
}


@pytest.mark.parametrize("name", ["images", "videos"])
def test_aligned_equals_own_batch(model, name):
    samples = ALIGNED[name]
    batch = fam.make_batch(model, samples)
    out = logits(model, batch)
    for i, sample in enumerate(samples):
        ref = own(model, sample)
        torch.testing.assert_close(out[i, : batch.lengths[i]], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "samples",
    [ALIGNED["image+video in one sample"], [[img(4, 4), vid(2, 4, 4)]]],
    ids=["across samples", "one sample"],
)
def test_plain_model_raises_on_aligned_mixed_batch(model, samples):
    """Both masks are ``input_ids == image_token_id``: the image merge counts the video frames too."""
    batch = fam.make_batch(model, samples)
    n_img = sum(n for _, m, n in batch.items if m == "image")
    n_all = sum(n for _, _, n in batch.items)
    with pytest.raises(
        ValueError,
        match=f"Image features and image tokens do not match, tokens: {n_all}, features: {n_img}",
    ):
        logits(model, batch)


def test_layout(model):
    batch = fam.make_batch(model, [[img(4, 6), vid(2, 2, 4)], [img(2, 2)]])
    kw = batch.kwargs
    assert (
        kw["pixel_values"].shape == (24 + 4, fam.PATCH_DIM)
        and kw["pixel_values"].dtype == torch.float32
    )
    assert kw["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]
    assert kw["pixel_values_videos"].shape == (16, fam.PATCH_DIM)
    assert kw["video_grid_thw"].tolist() == [[2, 2, 4]]
    assert batch.items == [(0, "image", 6), (1, "image", 1), (0, "video", 4)]
    assert batch.runs == [[("image", 6), ("video", 2), ("video", 2)], [("image", 1)]]
    ids, types = kw["input_ids"][0], kw["mm_token_type_ids"][0]
    cfg = model.config
    assert int((ids == cfg.image_token_id).sum()) == 10 and int((types == 2).sum()) == 4
    assert int((ids == cfg.image_start_token_id).sum()) == 3
    assert (
        int((ids == cfg.video_start_token_id).sum())
        == 1
        == int((ids == cfg.video_end_token_id).sum())
    )
    assert int((ids == cfg.video_token_id).sum()) == 0


# Unguarded behaviour, measured: (samples, swap, expected error or None for "runs silently").
ROPE_CRASH = (RuntimeError, r"shape mismatch: value tensor of shape \[3, \d+\] cannot be broadcast")
FAULTS = {
    "short run": (
        [[img(4, 6, tokens=5)], [img(8, 4)]],
        None,
        (ValueError, "tokens: 13, features: 14"),
    ),
    "+k/-k images": ([[img(4, 6, tokens=8)], [img(8, 4, tokens=6), img(2, 2)]], None, ROPE_CRASH),
    "+k/-k videos": ([[vid(2, 4, 4, tokens=10)], [vid(3, 2, 4, tokens=4)]], None, ROPE_CRASH),
    "swap of different counts": ([[img(4, 6)], [img(8, 4), img(2, 2)]], (0, 1), ROPE_CRASH),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_unguarded_fault_raises(model, name):
    samples, swap, (err, match) = FAULTS[name]
    with pytest.raises(err, match=match):
        logits(model, fam.make_batch(model, samples, swap=swap))


def test_unguarded_swap_of_equal_counts_is_silent(model):
    """A 4×6 and a 6×4 grid (6 tokens each) exchanged: rope and the merge see equal counts, and
    each sample runs on the other's features."""
    samples = [[img(4, 6)], [img(6, 4)]]
    batch = fam.make_batch(model, samples, swap=(0, 1))
    out = logits(model, batch)
    for i, sample in enumerate(samples):
        assert not torch.allclose(out[i, : batch.lengths[i]], own(model, sample), atol=1e-3)


@pytest.mark.parametrize(
    "hw", [(50, 60), (224, 224), (300, 171), (1080, 2400), (20, 400), (3000, 4000)]
)
def test_image_grid_matches_processor(hw):
    """Oracle: the fixture's resize arithmetic gives the PIL image processor's ``image_grid_thw``."""
    from PIL import Image
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    out = Glm4vImageProcessorPil()(
        images=[Image.fromarray(np.zeros((*hw, 3), np.uint8))], return_tensors="pt"
    )
    t, h, w = fam.image_grid(*hw)
    assert out["image_grid_thw"].tolist() == [[t, h, w]]
    assert tuple(out["pixel_values"].shape) == (t * h * w, fam.PATCH_DIM)
