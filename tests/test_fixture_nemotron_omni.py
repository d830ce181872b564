"""The Nemotron 3 Nano Omni fixture against the real transformers class (tiny random config, CPU):
the processor's arithmetic matches its source; the unguarded paths of its own (``inputs_embeds``
alone, EVS pruning), as measured. The batch layout and the other unguarded faults:
``tests/test_fixture_plain.py``; aligned batches: ``tests/families/``."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from megatron_media_guard.testing.families import nemotron_omni as F
from megatron_media_guard.testing.families.base import Media as M

pytest.importorskip("transformers.models.nemotron_h_omni")
from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (
    NemotronH_Omni_Reasoning_V3Processor as P,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


@pytest.fixture(scope="module")
def evs_model():
    return F.tiny_model(seed=0, video_pruning_rate=0.5)


AUD_A, AUD_C = M("audio", (40,)), M("audio", (25,))


# ---- the processor's own arithmetic -------------------------------------------------------


def _processor_ns():
    return types.SimpleNamespace(
        image_start_token="<img>",
        image_end_token="</img>",
        image_token="<image>",
        video_temporal_patch_dim=2,
        video_processor=types.SimpleNamespace(patch_size=16, downsample_ratio=0.5),
        audio_hop_length=160,
        audio_subsampling_factor=8,
    )


@pytest.mark.parametrize("frames", [1, 3, 4])
def test_video_ids_follow_replace_video_token(model, frames):
    t = -(-frames // 2)
    meta = types.SimpleNamespace(fps=F.FPS, frames_indices=list(range(frames)))
    inputs = {
        "num_frames": [frames],
        "video_metadata": [meta],
        "pixel_values_videos": torch.zeros(1, t, 6, 64, 64),
    }
    text = P.replace_video_token(_processor_ns(), inputs, 0)
    want: list[int] = []
    for piece in text.replace("<img>", "\0<img>\0").replace("</img>", "\0</img>\0").split("\0"):
        marks = {"<img>": [F.IMG_START], "</img>": [F.IMG_END]}
        want += marks.get(piece) or [F.IMAGE] * piece.count("<image>") or F.text_ids(piece)
    b = F.make_batch(model, [[M("video", (frames, 4, 4))]], text_len=0)
    assert b.input_ids[0, 1:].tolist() == want


def test_tubelets_match_the_models_own_packing(model):
    """``get_video_features`` packs raw ``[frames, C, H, W]`` itself (deprecated path): same features."""
    b = F.make_batch(model, [[M("video", (3, 4, 4))]])
    stacked = b.kwargs["pixel_values_videos"]
    frames = stacked[0].reshape(-1, 3, 64, 64)[:3]  # drop the padding frame
    with torch.no_grad():
        ours = model.get_video_features(stacked).pooler_output
        theirs = model.get_video_features(frames).pooler_output
    torch.testing.assert_close(ours[0], theirs[0])


@pytest.mark.parametrize("samples", [4000, 6399, 16000, 23999])
def test_audio_layout_and_count_follow_the_feature_extractor(model, samples):
    from transformers.models.parakeet.feature_extraction_parakeet import ParakeetFeatureExtractor

    wave = np.random.default_rng(0).standard_normal(samples).astype(np.float32)
    out = ParakeetFeatureExtractor(feature_size=F.MEL)(
        [wave], sampling_rate=16000, return_tensors="pt"
    )
    frames = int(out["attention_mask"].sum())
    b = F.make_batch(model, [[M("audio", (frames,))]])
    assert b.kwargs["input_features"].shape == out["input_features"].shape
    assert b.kwargs["input_features_mask"].dtype == out["attention_mask"].dtype
    assert b.items[0][2] == P._estimate_audio_num_embeddings(_processor_ns(), samples)


@pytest.mark.parametrize("media", [M("image", (4, 4)), AUD_A], ids=["image", "audio"])
def test_inputs_embeds_without_input_ids_merges_images_but_drops_audio_silently(model, media):
    """forward merges audio only when ``input_ids`` is given: embeds alone ignore the clip."""
    b = F.make_batch(model, [[media]])
    kw = dict(b.kwargs)
    emb = model.get_input_embeddings()(kw.pop("input_ids"))
    with torch.no_grad():
        out = model(inputs_embeds=emb, **kw).logits
    plain = F.plain_logits(model, b)
    if media.modality == "image":
        torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)
    else:  # as without the clip at all
        del kw["input_features"], kw["input_features_mask"]
        with torch.no_grad():
            without = model(inputs_embeds=emb, **kw).logits
        torch.testing.assert_close(out, without, atol=0, rtol=0)
        assert (out - plain).abs().max() > 1e-3


# EVS (video_pruning_rate > 0): the prune reshapes the batch to rows of equal kept length
# (rows of unequal pruning that still divide: tests/test_family_nemotron_omni.py).
def test_evs_rows_with_unequal_pruning_raise_when_not_divisible(evs_model):
    """5 tubelets of 1 token keep max(1, int(5 * 0.5)) = 2: 3 pruned from one row of two."""
    batch = F.make_batch(evs_model, [[M("video", (10, 2, 2))], [AUD_C]])
    with pytest.raises(RuntimeError, match=r"shape '\[2, -1, 32\]' is invalid"):
        F.plain_logits(evs_model, batch)


def test_evs_plus_minus_k_runs_silently(evs_model):
    batch = F.make_batch(
        evs_model, [[M("video", (4, 4, 4), tokens=9)], [M("video", (4, 4, 4), tokens=7)]]
    )
    F.plain_logits(evs_model, batch)  # no error: the retention mask is laid over the wrong rows
