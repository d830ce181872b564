"""Qwen3-Omni thinker fixture: aligned batches equal per-sample forwards; unguarded faults, measured and pinned."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard.testing.families import qwen3_omni as fam
from megatron_media_guard.testing.families.base import Media

pytest.importorskip("transformers")


def img(h, w, tokens=None):
    return Media("image", (h, w), tokens)


def vid(t, h, w, tokens=None):
    return Media("video", (t, h, w), tokens)


def aud(length, tokens=None):
    return Media("audio", (length,), tokens)


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
    """Per placeholder row (row-major, as masked_scatter fills them): the sample of the row and
    the sample that owns the feature put there; checked against the embeddings the LM received."""
    seen = {}

    def grab(_module, _args, kw):
        seen["emb"] = kw["inputs_embeds"]

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        logits(model, batch)
    finally:
        hook.remove()
    kw, mm = batch.kwargs, model.model
    with torch.no_grad():
        if modality == "audio":
            feats = mm.get_audio_features(
                kw["input_features"], kw["feature_attention_mask"]
            ).last_hidden_state
        elif modality == "image":
            feats = torch.cat(
                mm.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output
            )
        else:
            feats = torch.cat(
                mm.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"]).pooler_output
            )
    pad = {
        "image": model.config.image_token_id,
        "video": model.config.video_token_id,
        "audio": model.config.audio_token_id,
    }
    where = kw["input_ids"] == pad[modality]
    n = int(where.sum())
    torch.testing.assert_close(seen["emb"][where], feats[:n], atol=1e-6, rtol=0)
    rows = where.nonzero()[:, 0].tolist()
    owners = [s for s, m, c in batch.items if m == modality for _ in range(c)][:n]
    return list(zip(rows, owners))


ALIGNED = {
    "images": [[img(4, 6)], [img(8, 4), img(2, 2)]],
    "videos": [[vid(2, 4, 4)], [vid(3, 2, 4)]],
    "audio": [[aud(100)], [aud(60), aud(230)]],
    "mixed": [[img(4, 4), aud(80)], [vid(2, 4, 4)], [aud(50), img(2, 2)]],
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
    batch = fam.make_batch(model, [[img(4, 6), aud(230)], [vid(2, 2, 4), aud(60)]])
    kw = batch.kwargs
    assert kw["pixel_values"].shape == (24, fam.PATCH_DIM) and kw["image_grid_thw"].tolist() == [
        [1, 4, 6]
    ]
    assert kw["pixel_values_videos"].shape == (16, fam.PATCH_DIM) and kw[
        "video_grid_thw"
    ].tolist() == [[2, 2, 4]]
    assert kw["video_second_per_grid"].tolist() == [2.0]
    assert (
        kw["input_features"].shape == (2, 128, 230)
        and kw["feature_attention_mask"].dtype == torch.int32
    )
    assert kw["feature_attention_mask"].sum(-1).tolist() == [230, 60]
    assert batch.items == [(0, "audio", 30), (1, "audio", 8), (0, "image", 6), (1, "video", 4)]
    assert batch.runs == [[("image", 6), ("audio", 30)], [("video", 4), ("audio", 8)]]
    # the model's own length function agrees with the fixture's
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    lengths = torch.tensor([1, 50, 60, 99, 100, 101, 230, 3000])
    assert _get_feat_extract_output_lengths(lengths).tolist() == [
        fam.audio_tokens(int(n)) for n in lengths
    ]
    ids = kw["input_ids"]
    assert int((ids == fam.VISION_START).sum()) == 2 == int((ids == fam.VISION_END).sum())
    assert (
        int((ids == model.config.audio_start_token_id).sum())
        == 2
        == int((ids == fam.AUDIO_END).sum())
    )


def test_thinker_config_lacks_vision_start_token_id():
    bare = fam.tiny_model(vision_start_token_id=None)
    with pytest.raises(AttributeError, match="has no attribute 'vision_start_token_id'"):
        logits(bare, fam.make_batch(bare, [[img(2, 2)]]))


RAISES = {
    "short image run": (
        [[img(4, 6, tokens=5)], [img(8, 4)]],
        None,
        ValueError,
        "tokens: 13, features: 14",
    ),
    "surplus audio run": (
        [[aud(100, tokens=16)], [aud(60)]],
        None,
        RuntimeError,
        "source < number of ones in mask",
    ),
    # with a grid present get_rope_index walks the audio runs by feature length and trips
    "short audio run beside an image": (
        [[aud(100, tokens=10), img(2, 2)], [aud(60)]],
        None,
        ValueError,
        "151652 is not in list",
    ),
    "+k/-k audio beside an image": (
        [[aud(100, tokens=16), img(2, 2)], [aud(60, tokens=5)]],
        None,
        RuntimeError,
        r"shape mismatch: value tensor of shape \[3, 16\]",
    ),
}


@pytest.mark.parametrize("name", list(RAISES))
def test_unguarded_fault_raises(model, name):
    samples, swap, err, match = RAISES[name]
    with pytest.raises(err, match=match):
        logits(model, fam.make_batch(model, samples, swap=swap))


# (samples, swap, modality, the sample whose row receives another sample's features)
SILENT = {
    "+k/-k images": ([[img(4, 6, tokens=8)], [img(8, 4, tokens=6)]], None, "image", 0),
    "+k/-k videos": ([[vid(2, 4, 4, tokens=10)], [vid(3, 2, 4, tokens=4)]], None, "video", 0),
    "swap of images": ([[img(4, 6)], [img(8, 4)]], (0, 1), "image", 0),
    "short audio run (no count check)": ([[aud(100, tokens=10)], [aud(60)]], None, "audio", 1),
    "+k/-k audio": ([[aud(100, tokens=16)], [aud(60, tokens=5)]], None, "audio", 0),
    "swap of audio clips": ([[aud(100)], [aud(60)]], (0, 1), "audio", 0),
}


@pytest.mark.parametrize("name", list(SILENT))
def test_unguarded_fault_is_silent(model, name):
    samples, swap, modality, victim = SILENT[name]
    batch = fam.make_batch(model, samples, swap=swap)
    rows = placed(model, batch, modality)
    assert any(row == victim and owner != victim for row, owner in rows)
    if name == "short audio run (no count check)":
        n_feats = sum(c for _, m, c in batch.items if m == "audio")
        assert len(rows) < n_feats  # the last clip's tail rows are dropped, nothing raised
    if swap is not None:  # equal row lengths: the logits show it too
        out = logits(model, batch)
        for i, sample in enumerate(samples):
            assert not torch.allclose(out[i, : batch.lengths[i]], own(model, sample), atol=1e-3)
