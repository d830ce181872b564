"""Kimi K2.5 fixture: aligned batches equal per-sample forwards; the unguarded faults, measured and pinned."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard.testing.families import kimi_k25 as fam
from megatron_media_guard.testing.families.base import Media

pytest.importorskip("transformers")


def img(h, w, tokens=None):
    return Media("image", (h, w), tokens)


def vid(f, h, w, tokens=None):
    return Media("video", (f, h, w), tokens)


@pytest.fixture(scope="module")
def model():
    return fam.tiny_model(seed=0)


def logits(model, batch):
    with torch.no_grad():
        return model(**batch.kwargs).logits


def own(model, sample):
    """The aligned sample's logits in a batch of its own."""
    return logits(model, fam.make_batch(model, [[Media(m.modality, m.size) for m in sample]]))[0]


def placed(model, batch, modality):
    """Per placeholder row (row-major, as masked_scatter fills them): (its sample, the sample owning
    the feature put there), checked against the embeddings the LM received."""
    seen = {}

    def grab(_module, _args, kw):
        seen["emb"] = kw["inputs_embeds"]

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        logits(model, batch)
    finally:
        hook.remove()
    kw = batch.kwargs
    key = "pixel_values" if modality == "image" else "pixel_values_videos"
    with torch.no_grad():
        feats = torch.cat(
            model.model.get_image_features(kw[key], kw[f"{modality}_grid_thw"]).pooler_output
        )
    pad = model.config.image_token_id if modality == "image" else model.config.video_token_id
    where = kw["input_ids"] == pad
    n = int(where.sum())
    torch.testing.assert_close(seen["emb"][where], feats[:n], atol=1e-6, rtol=0)
    owners = [s for s, m, c in batch.items if m == modality for _ in range(c)][:n]
    return list(zip(where.nonzero()[:, 0].tolist(), owners))


ALIGNED = {
    "images": [[img(4, 6)], [img(8, 4), img(2, 2)]],
    "videos": [[vid(6, 4, 4)], [vid(3, 2, 4)]],
    "mixed": [[img(4, 4)], [vid(6, 4, 4)], [vid(2, 2, 2), img(2, 2)]],
}


@pytest.mark.parametrize("name", list(ALIGNED))
def test_aligned_equals_own_batch(model, name):
    samples = ALIGNED[name]
    batch = fam.make_batch(model, samples)
    out = logits(model, batch)
    for i, sample in enumerate(samples):
        torch.testing.assert_close(
            out[i, : batch.lengths[i]], own(model, sample), atol=1e-5, rtol=0
        )


def test_layout(model):
    batch = fam.make_batch(model, [[img(4, 6), vid(9, 2, 4)], [img(2, 2)]])
    kw, cfg = batch.kwargs, model.config
    assert kw["pixel_values"].shape == (28, 3, 14, 14) and kw["image_grid_thw"].tolist() == [
        [1, 4, 6],
        [1, 2, 2],
    ]
    assert kw["pixel_values_videos"].shape == (72, 3, 14, 14)
    assert kw["video_grid_thw"].tolist() == [
        [4, 2, 4],
        [4, 2, 4],
        [1, 2, 4],
    ]  # chunks of <= 4 frames
    assert batch.items == [(0, "image", 6), (1, "image", 1), (0, "video", 6)]
    assert batch.runs == [[("image", 6), ("video", 2), ("video", 2), ("video", 2)], [("image", 1)]]
    ids = kw["input_ids"][0]
    assert (
        int((ids == cfg.vision_start_token_id).sum())
        == 4
        == int((ids == cfg.vision_end_token_id).sum())
    )
    assert int((ids == fam.MEDIA_CONTENT).sum()) == 4
    with torch.no_grad():  # time pooling: one feature row per chunk position, not per frame
        feats = model.model.get_video_features(
            kw["pixel_values_videos"], kw["video_grid_thw"]
        ).pooler_output
    assert [f.shape[0] for f in feats] == [2, 2, 2]


def test_unguarded_short_run_raises(model):
    with pytest.raises(
        ValueError, match="Image features and image tokens do not match, tokens: 13, features: 14"
    ):
        logits(model, fam.make_batch(model, [[img(4, 6, tokens=5)], [img(8, 4)]]))


# (samples, swap, modality, the sample whose row receives another sample's features)
SILENT = {
    "+k/-k images": ([[img(4, 6, tokens=8)], [img(8, 4, tokens=6)]], None, "image", 0),
    "+k/-k videos": ([[vid(6, 4, 4, tokens=10)], [vid(3, 2, 4, tokens=0)]], None, "video", 0),
    "swap of images": ([[img(4, 6)], [img(8, 4)]], (0, 1), "image", 0),
    "swap of videos": ([[vid(6, 4, 4)], [vid(3, 2, 4)]], (0, 1), "video", 0),
}


@pytest.mark.parametrize("name", list(SILENT))
def test_unguarded_fault_is_silent(model, name):
    samples, swap, modality, victim = SILENT[name]
    batch = fam.make_batch(model, samples, swap=swap)
    rows = placed(model, batch, modality)
    assert any(row == victim and owner != victim for row, owner in rows)
    if swap is not None:
        out = logits(model, batch)
        for i, sample in enumerate(samples):
            assert not torch.allclose(out[i, : batch.lengths[i]], own(model, sample), atol=1e-3)
