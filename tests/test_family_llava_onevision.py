"""install_vlm on transformers' real ``LlavaOnevisionForConditionalGeneration`` (tiny random
config, CPU): bare ``<image>`` / ``<video>`` runs, anyres counts from ``image_sizes``, base + 1
for the images of a multi-image sample (``batch_num_images``), pooled videos.

The fixture's counts (``testing/families/llava_onevision.py``) first, against the processor's
own code (``LlavaOnevisionProcessor``'s counting methods on a stand-in ``self``: it cannot be
built without torchvision) fed with the real ``LlavaOnevisionImageProcessorPil`` outputs, and
against the model's own ``get_image_features`` / ``get_video_features``; then repair. The plain
class under the faults: ``tests/test_fixture_plain.py``; the shared contract and the family's
own faults: ``tests/families/``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from family_checks import decoder_inputs, guarded_forward, img, own_logits, records, vid

from megatron_media_guard import GuardConfig
from megatron_media_guard.families import anyres_pixels
from megatron_media_guard.families import llava_onevision as spec_mod
from megatron_media_guard.geometry.anyres import fitted_size
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.llava_onevision")

from megatron_media_guard.testing.families import llava_onevision as F

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    """The fixture's model with a narrow output head (1000 of the 151680 ids; the text ids are
    drawn below 1000): the logits stay small, and every position's hidden state still shows."""
    m = F.tiny_model()
    torch.manual_seed(1)
    m.lm_head = torch.nn.Linear(m.config.text_config.hidden_size, F.TEXT_IDS[1], bias=False)
    m.config.text_config.vocab_size = F.TEXT_IDS[1]  # the loss reshapes logits by it
    return m


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
        image_token=F.IMAGE_TOKEN,
        video_token=F.VIDEO_TOKEN,
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
        assert F.select_best_resolution(h, w, cfg.image_grid_pinpoints) == select_best_resolution(
            (h, w), cfg.image_grid_pinpoints
        )
        want = proc._get_number_of_features(h, w, F.TILE, F.TILE)
        assert F.llava_onevision_num_features(h, w, cfg) == want, (h, w)


def _image_processor():
    """transformers' real ``LlavaOnevisionImageProcessorPil`` at the fixture's tile and
    pinpoints."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    return LlavaOnevisionImageProcessorPil(
        size={"height": F.TILE, "width": F.TILE}, image_grid_pinpoints=F.PINPOINTS
    )


def _pil(h, w, rng):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("aspect", ["anyres_max_9", "anyres_max_4"])
def test_counts_match_image_processor_processor_and_model(aspect):
    model = F.tiny_model(vision_aspect_ratio=aspect)
    rng = np.random.default_rng(0)
    per_sample = [[(1000, 1000)], [(30, 300), (56, 56)], [(57, 2500)], [(333, 999)], [(20, 20)]]
    images = [[_pil(h, w, rng) for h, w in s] for s in per_sample]
    out = _image_processor()(images, return_tensors="pt")
    proc = _processor_self(model.config)
    n_images = sum(len(s) for s in per_sample)
    from_proc = [proc.replace_image_token(out, q).count(F.IMAGE_TOKEN) for q in range(n_images)]
    with torch.no_grad():
        feats = model.model.get_image_features(
            out["pixel_values"], out["image_sizes"], batch_num_images=out["batch_num_images"]
        ).pooler_output
    b = F.make_batch(model, [[img(h, w) for h, w in s] for s in per_sample])
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
        F.num_tiles(h, w, model.config, multi_image=len(s) > 1) for s in per_sample for h, w in s
    ]
    assert tiles == [37, 1, 1, 7, 13, 2]  # multi-image: one padded-to-square tile each
    for q, t in enumerate(tiles):
        assert out["pixel_values"][q, t:].abs().sum() == 0


def test_video_count_matches_processor_and_model(model):
    proc = _processor_self(model.config)
    b = F.make_batch(model, [[vid(3)], [vid(3)]])
    pv = b.kwargs["pixel_values_videos"]
    from_proc = len(proc.replace_video_token({"pixel_values_videos": pv}, 0)) // len(F.VIDEO_TOKEN)
    with torch.no_grad():
        feats = model.model.get_video_features(pv).pooler_output
    assert from_proc == feats.shape[1] == F.video_num_features(3, model.config) == 3 * 2 * 2 + 1
    assert b.items == [(0, "video", 13), (1, "video", 13)]


ALL = [img(80, 80)]  # an aligned sample beside the faults: it must stay its own forward
ANY = ("engine-replay", "unique", "closest-aspect")  # anyres repairs are closest-aspect


def test_repair_reencodes_a_short_and_a_long_run(model, tmp_path):
    """56x56 gives 36 features; runs of 34 (short) and 40 (long) are re-encoded at sizes whose
    anyres count is the run's; the aligned sample between them stays its own forward."""
    samples = [[img(56, 56, n=34)], ALL, [img(56, 56, n=40)]]
    cfg = GuardConfig(policy="repair", allowed_fidelity=ANY, log_dir=str(tmp_path))
    emb, (b, out, res) = decoder_inputs(
        model.model.language_model, lambda: guarded_forward(F, model, samples, cfg)
    )
    out = out.logits
    assert res.report.actions == ("repair", "keep", "repair")
    reps = [r for r in records(tmp_path) if r["event"] == "repair"]
    assert [r["action"] for r in reps] == ["repair", "repair"]
    assert [r["fidelity"] for r in reps] == ["closest-aspect"] * 2
    geo = spec_mod._geometry(model)
    assert [geo.tokens(tuple(r["extra"]["size_hw"])) for r in reps] == [34, 40]
    want = own_logits(F, model, ALL)
    torch.testing.assert_close(out[1, : b.lengths[1]], want, atol=1e-5, rtol=1e-5)
    # by hand: sample 0's pixels resized to the solved size, tiled, fed to the plain model
    one = F.make_batch(model, [samples[0]])
    size = tuple(reps[0]["extra"]["size_hw"])
    pix = anyres_pixels.stitch(geo, one.kwargs["pixel_values"][0], 56, 56)
    pv = anyres_pixels.tiles_for(geo, resize_frames(pix[None], size)[0])[None]
    fixed = {**one.kwargs, "pixel_values": pv, "image_sizes": torch.tensor([size])}
    with torch.no_grad():
        want = model(**fixed).logits[0]
    torch.testing.assert_close(out[0, : b.lengths[0]], want, atol=1e-5, rtol=1e-5)
    text = model.get_input_embeddings()(b.input_ids)
    for k, n in ((0, 34), (2, 40)):  # every placeholder of the run took a feature
        ph = b.input_ids[k] == model.config.image_token_id
        assert int(ph.sum()) == n and not torch.equal(emb[k][ph], text[k][ph])
        assert torch.isfinite(out[k]).all()


def test_tiles_are_the_processors_and_stitch_back_exactly(model):
    """The real Pil processor on an image already at its fitted size (no resize): its tiles
    stitched with the padding cut are the normalized image itself, and ``tiles_for`` on that
    image gives the processor's pinpoint tiles exactly (the base tile up to the resampler)."""
    from PIL import Image

    geo, ip = spec_mod._geometry(model), _image_processor()
    rng = np.random.default_rng(0)
    for h, w in [(112, 80), (56, 150), (168, 168), (100, 112)]:
        assert fitted_size(h, w, geo.size_for((h, w))) == (h, w)
        raw = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        pv = ip([[Image.fromarray(raw)]], return_tensors="pt")["pixel_values"][0]
        mean, std = (
            torch.tensor(v)[:, None, None] for v in (anyres_pixels.MEAN, anyres_pixels.STD)
        )
        norm = (torch.from_numpy(raw).permute(2, 0, 1) / 255 - mean) / std
        stitched = anyres_pixels.stitch(geo, pv, h, w)
        torch.testing.assert_close(stitched, norm, atol=1e-5, rtol=0)
        tiles = anyres_pixels.tiles_for(geo, stitched)
        assert tiles.shape == pv.shape
        torch.testing.assert_close(tiles[1:], pv[1:], atol=1e-5, rtol=0)
        assert (tiles[0] - pv[0]).abs().mean() < 0.1  # torch vs PIL bicubic on the base tile
