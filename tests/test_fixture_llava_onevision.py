"""The LLaVA-OneVision fixture on the real transformers class (tiny random config, CPU).

1. ``llava_onevision_num_features`` against the processor's own code
   (``LlavaOnevisionProcessor._get_number_of_features`` / ``replace_image_token`` /
   ``replace_video_token``, called on a stand-in ``self``: the processor cannot be built without
   torchvision) fed with the real ``LlavaOnevisionImageProcessorPil`` outputs, and against the
   model's own ``get_image_features`` / ``get_video_features``;
2. aligned batches (images, multi-image, video, mixed): each sample's hidden states equal its own
   batch's (hidden states, not logits: the 151680-wide ``lm_head`` is linear and costs the most);
3. the unguarded behaviour, pinned.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from megatron_media_guard.testing.families import llava_onevision as fam
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)


def img(h: int, w: int, tokens: int | None = None) -> Media:
    return Media("image", (h, w), tokens)


def vid(frames: int, tokens: int | None = None) -> Media:
    return Media("video", (frames,), tokens)


@pytest.fixture(scope="module")
def model():
    return fam.tiny_model(seed=0)


def _hidden(model, kwargs):
    with torch.no_grad():
        return model.model(**kwargs).last_hidden_state


def _run(model, kwargs):
    """(hidden states, ``inputs_embeds`` the LM received)."""
    seen = {}

    def grab(_mod, _args, kw):
        seen["emb"] = kw["inputs_embeds"].detach().clone()

    h = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        hidden = _hidden(model, kwargs)
    finally:
        h.remove()
    return hidden, seen["emb"]


def _image_feats(model, kwargs):
    with torch.no_grad():
        return model.model.get_image_features(
            kwargs["pixel_values"],
            kwargs["image_sizes"],
            batch_num_images=kwargs["batch_num_images"],
        ).pooler_output


def _own(model, sample):
    return _hidden(model, fam.make_batch(model, [sample]).kwargs)[0]


# -- 1. oracles ---------------------------------------------------------------------------------


def _processor_self(config):
    """What ``LlavaOnevisionProcessor``'s counting methods read from ``self``."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    side = config.vision_config.image_size // config.vision_config.patch_size
    proc = types.SimpleNamespace(
        num_image_tokens=side * side,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        vision_aspect_ratio=config.vision_aspect_ratio,
        image_token=fam.IMAGE_TOKEN,
        video_token=fam.VIDEO_TOKEN,
        image_processor=types.SimpleNamespace(image_grid_pinpoints=config.image_grid_pinpoints),
    )
    for name in ("_get_number_of_features", "_get_unpadded_features", "replace_image_token"):
        setattr(proc, name, types.MethodType(getattr(LlavaOnevisionProcessor, name), proc))
    proc.replace_video_token = types.MethodType(LlavaOnevisionProcessor.replace_video_token, proc)
    return proc


SIZES = [(h, w) for h in (1, 20, 56, 57, 100, 333, 1000, 3000) for w in (1, 30, 56, 300, 999, 2500)]


@pytest.mark.parametrize("aspect", ["anyres_max_9", "anyres_max_4"])
def test_count_matches_processor_arithmetic(model, aspect):
    from transformers.image_processing_utils import select_best_resolution

    cfg = types.SimpleNamespace(
        vision_config=model.config.vision_config,
        image_grid_pinpoints=model.config.image_grid_pinpoints,
        vision_aspect_ratio=aspect,
        vision_feature_select_strategy="full",
    )
    proc = _processor_self(cfg)
    for h, w in SIZES:
        assert fam.select_best_resolution(h, w, cfg.image_grid_pinpoints) == select_best_resolution(
            (h, w), cfg.image_grid_pinpoints
        )
        want = proc._get_number_of_features(h, w, fam.TILE, fam.TILE)
        assert fam.llava_onevision_num_features(h, w, cfg) == want, (h, w)


def _pil(h, w, rng):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("aspect", ["anyres_max_9", "anyres_max_4"])
def test_counts_match_image_processor_processor_and_model(aspect):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    model = fam.tiny_model(vision_aspect_ratio=aspect)
    ip = LlavaOnevisionImageProcessorPil(
        size={"height": fam.TILE, "width": fam.TILE}, image_grid_pinpoints=fam.PINPOINTS
    )
    rng = np.random.default_rng(0)
    per_sample = [[(1000, 1000)], [(30, 300), (56, 56)], [(57, 2500)], [(333, 999)], [(20, 20)]]
    out = ip([[_pil(h, w, rng) for h, w in s] for s in per_sample], return_tensors="pt")
    proc = _processor_self(model.config)
    n_images = sum(len(s) for s in per_sample)
    from_proc = [proc.replace_image_token(out, q).count(fam.IMAGE_TOKEN) for q in range(n_images)]
    feats = _image_feats(model, out)
    b = fam.make_batch(model, [[img(h, w) for h, w in s] for s in per_sample])
    assert from_proc == [f.shape[0] for f in feats] == [n for _, _, n in b.items]
    # the fixture's layout is the processor's: shapes, dtypes, sizes, batch_num_images
    for name in ("pixel_values", "image_sizes", "batch_num_images"):
        assert b.kwargs[name].shape == out[name].shape, name
        assert b.kwargs[name].dtype == out[name].dtype, name
    assert b.kwargs["image_sizes"].tolist() == out["image_sizes"].tolist()
    assert (
        b.kwargs["batch_num_images"].tolist() == out["batch_num_images"].tolist() == [1, 2, 1, 1, 1]
    )
    # zero tiles after an image's own (the model slices them off by image_size_to_num_patches)
    tiles = [
        fam.num_tiles(h, w, model.config, multi_image=len(s) > 1) for s in per_sample for h, w in s
    ]
    assert tiles == [37, 1, 1, 7, 13, 2]  # multi-image: one padded-to-square tile each
    for q, t in enumerate(tiles):
        assert out["pixel_values"][q, t:].abs().sum() == 0


def test_video_count_matches_processor_and_model(model):
    proc = _processor_self(model.config)
    b = fam.make_batch(model, [[vid(3)], [vid(3)]])
    pv = b.kwargs["pixel_values_videos"]
    from_proc = len(proc.replace_video_token({"pixel_values_videos": pv}, 0)) // len(
        fam.VIDEO_TOKEN
    )
    with torch.no_grad():
        feats = model.model.get_video_features(pv).pooler_output
    assert from_proc == feats.shape[1] == fam.video_num_features(3, model.config) == 3 * 2 * 2 + 1
    assert b.items == [(0, "video", 13), (1, "video", 13)]


# -- 2. aligned ---------------------------------------------------------------------------------

ALIGNED = {
    "single_images": [[img(100, 60)], [img(1000, 333)], []],
    "multi_image_sample": [[img(30, 300), img(56, 56)], [img(200, 200)]],
    "video": [[vid(2)], [], [vid(2)]],
    "mixed_image_video": [
        [img(100, 60), vid(2)],
        [vid(2), img(20, 20), img(80, 90)],
        [img(500, 50)],
    ],
}


@pytest.mark.parametrize("name", sorted(ALIGNED))
def test_aligned_each_sample_equals_its_own_batch(model, name):
    samples = ALIGNED[name]
    b = fam.make_batch(model, samples)
    hidden = _hidden(model, b.kwargs)
    for s, sample in enumerate(samples):
        n = b.lengths[s]
        torch.testing.assert_close(hidden[s, :n], _own(model, sample), atol=1e-5, rtol=0)


def test_aligned_multi_image_without_batch_num_images_raises(model):
    # the count of a multi-image sample depends on batch_num_images; dropped, anyres counts apply
    b = fam.make_batch(model, ALIGNED["multi_image_sample"])
    kwargs = {k: v for k, v in b.kwargs.items() if k != "batch_num_images"}
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        model.model(**kwargs)


# -- 3. unguarded -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "samples, match",
    [
        (
            [[img(100, 60, tokens=55)]],
            "Image features and image tokens do not match, tokens: 55, features: 56$",
        ),
        ([[img(100, 60, tokens=57)]], "tokens: 57, features: 56$"),
        (
            [[vid(2, tokens=8)]],
            "Video features and video tokens do not match, tokens: 8, features: 9$",
        ),
        ([[img(100, 60), vid(2, tokens=10)]], "Video features .* tokens: 10, features: 9$"),
    ],
)
def test_unguarded_count_mismatch_raises(model, samples, match):
    with pytest.raises(ValueError, match=match):
        model.model(**fam.make_batch(model, samples).kwargs)


@pytest.mark.parametrize("k", [1, 5])
def test_unguarded_plus_minus_k_is_silent_and_moves_features(model, k):
    b = fam.make_batch(model, [[img(100, 60, tokens=56 + k)], [img(200, 200, tokens=172 - k)]])
    _, emb = _run(model, b.kwargs)
    feats = _image_feats(model, b.kwargs)
    pos0 = (b.input_ids[0] == model.config.image_token_id).nonzero().flatten()
    pos1 = (b.input_ids[1] == model.config.image_token_id).nonzero().flatten()
    torch.testing.assert_close(emb[0, pos0[56:]], feats[1][:k])  # sample 1's image in sample 0
    torch.testing.assert_close(emb[1, pos1], feats[1][k:])


def test_unguarded_plus_minus_k_across_videos_is_silent(model):
    b = fam.make_batch(model, [[vid(2, tokens=10)], [vid(2, tokens=8)]])
    _, emb = _run(model, b.kwargs)
    with torch.no_grad():
        feats = model.model.get_video_features(b.kwargs["pixel_values_videos"]).pooler_output
    pos0 = (b.input_ids[0] == model.config.video_token_id).nonzero().flatten()
    torch.testing.assert_close(emb[0, pos0[9:]], feats[1][:1])  # video 1's first row in sample 0


def test_unguarded_swap_is_silent_and_wrong(model):
    samples = [[img(100, 60)], [img(30, 300)]]  # 56 and 66 features
    b = fam.make_batch(model, samples, swap=(0, 1))
    assert [n for _, _, n in b.items] == [66, 56]
    hidden, emb = _run(model, b.kwargs)
    feats = _image_feats(model, b.kwargs)
    pos0 = (b.input_ids[0] == model.config.image_token_id).nonzero().flatten()
    torch.testing.assert_close(emb[0, pos0], feats[0][:56])  # the other image's first 56 rows
    for s, sample in enumerate(samples):
        assert not torch.allclose(hidden[s, : b.lengths[s]], _own(model, sample), atol=1e-3)
