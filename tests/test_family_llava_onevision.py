"""install_vlm on transformers' real ``LlavaOnevisionForConditionalGeneration`` (tiny random
config, CPU): bare ``<image>`` / ``<video>`` runs, anyres counts from ``image_sizes``, base + 1
for the images of a multi-image sample (``batch_num_images``), pooled videos.

Inputs come from ``testing/families/llava_onevision.py``. Aligned batches are compared with
the plain model on the same batch; kept samples of a guarded faulty batch with the same
sample's plain forward in a batch of its own (its own ``batch_num_images``).
"""

from __future__ import annotations

import pytest
import torch
from family_checks import records

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.families import anyres_pixels, find_family
from megatron_media_guard.families import llava_onevision as spec_mod
from megatron_media_guard.geometry.anyres import fitted_size
from megatron_media_guard.repair.reproject import resize_frames

pytest.importorskip("transformers.models.llava_onevision")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.testing.families import llava_onevision as F
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)


def img(h: int, w: int, tokens: int | None = None) -> Media:
    return Media("image", (h, w), tokens)


@pytest.fixture(scope="module")
def model():
    """The fixture's model with a narrow output head (1000 of the 151680 ids; the text ids are
    drawn below 1000): the logits stay small, and every position's hidden state still shows."""
    m = F.tiny_model()
    torch.manual_seed(1)
    m.lm_head = torch.nn.Linear(m.config.text_config.hidden_size, F.TEXT_IDS[1], bias=False)
    m.config.text_config.vocab_size = F.TEXT_IDS[1]  # the loss reshapes logits by it
    return m


def logits(model, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs).logits


def own(model, sample) -> torch.Tensor:
    b = F.make_batch(model, [sample])
    return logits(model, b.kwargs)[0, : b.lengths[0]]


def guarded(model, samples, config=None, items=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, config or GuardConfig()) as h:
        if items is not None:
            h.set_items(items)
        out = logits(model, b.kwargs)
        return b, out, h.last_result


def test_the_registry_finds_the_family_and_its_grammar(model):
    target, spec = find_family(model)
    assert spec is spec_mod.SPEC and target is model
    g = spec.grammar(model)
    assert dict(g.placeholders) == {"image": 151646, "video": 151647}
    assert (g.start_id, g.end_id, g.break_ids) == (None, None, ())
    assert find_family(model.model)[1] is spec_mod.SPEC
    assert F.llava_onevision_num_features(56, 56, model.config) == N56


ALL = [img(80, 80)]  # an aligned sample beside every fault: it must stay its own forward
N56 = 36  # a 56x56 image alone: base 16 + 4 rows of 4 + 1 newline (asserted below)
ANY = ("engine-replay", "unique", "closest-aspect")  # anyres repairs are closest-aspect


def _records(tmp_path, event):
    recs = records(tmp_path)
    return [r for r in recs if r["event"] == event]


def test_repair_reencodes_a_short_and_a_long_run(model, tmp_path):
    """56x56 gives 36 features; runs of 34 (short) and 40 (long) are re-encoded at sizes whose
    anyres count is the run's; the aligned sample between them stays its own forward."""
    samples = [[img(56, 56, tokens=34)], ALL, [img(56, 56, tokens=40)]]
    b = F.make_batch(model, samples)
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].detach().clone()), with_kwargs=True
    )
    try:
        cfg = GuardConfig(policy="repair", allowed_fidelity=ANY, log_dir=str(tmp_path))
        with install_vlm(model, cfg) as h:
            out = logits(model, b.kwargs)
            res = h.last_result
    finally:
        hook.remove()
    assert res.report.actions == ("repair", "keep", "repair")
    reps = _records(tmp_path, "repair")
    assert [r["action"] for r in reps] == ["repair", "repair"]
    assert [r["fidelity"] for r in reps] == ["closest-aspect"] * 2
    geo = spec_mod._geometry(model)
    assert [geo.tokens(tuple(r["extra"]["size_hw"])) for r in reps] == [34, 40]
    torch.testing.assert_close(out[1, : b.lengths[1]], own(model, ALL), atol=1e-5, rtol=1e-5)
    # by hand: sample 0's pixels resized to the solved size, tiled, fed to the plain model
    one = F.make_batch(model, [samples[0]])
    size = tuple(reps[0]["extra"]["size_hw"])
    pix = anyres_pixels.stitch(geo, one.kwargs["pixel_values"][0], 56, 56)
    pv = anyres_pixels.tiles_for(geo, resize_frames(pix[None], size)[0])[None]
    fixed = {**one.kwargs, "pixel_values": pv, "image_sizes": torch.tensor([size])}
    torch.testing.assert_close(
        out[0, : b.lengths[0]], logits(model, fixed)[0], atol=1e-5, rtol=1e-5
    )
    text = model.get_input_embeddings()(b.input_ids)
    for k, n in ((0, 34), (2, 40)):  # every placeholder of the run took a feature
        ph = b.input_ids[k] == model.config.image_token_id
        assert int(ph.sum()) == n and not torch.equal(seen[0][k][ph], text[k][ph])
        assert torch.isfinite(out[k]).all()


def test_repair_of_a_multi_image_sample_falls_back_saying_why(model, tmp_path):
    cfg = GuardConfig(policy="repair", fallback="drop", allowed_fidelity=ANY, log_dir=str(tmp_path))
    _, out, res = guarded(model, [[img(56, 56), img(100, 40, tokens=26)], ALL], cfg)
    assert res.report.actions == ("drop", "keep")
    (rep,) = _records(tmp_path, "repair")
    assert "multi-image sample" in rep["reason"] and "base + 1 = 17" in rep["reason"]
    torch.testing.assert_close(out[1, : F.make_batch(model, [ALL]).lengths[0]], own(model, ALL))


def test_repair_falls_back_where_no_size_gives_the_count(model, tmp_path):
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    _, _, res = guarded(
        model, [[img(56, 56, tokens=N56 - 1)], ALL], cfg
    )  # 35: no size gives an odd 16 + r * (c + 1)
    assert res.report.actions == ("drop", "keep")
    (rep,) = _records(tmp_path, "repair")
    assert rep["reason"].startswith("unreachable: no image size")


def test_tiles_are_the_processors_and_stitch_back_exactly(model):
    """The real Pil processor on an image already at its fitted size (no resize): its tiles
    stitched with the padding cut are the normalized image itself, and ``tiles_for`` on that
    image gives the processor's pinpoint tiles exactly (the base tile up to the resampler)."""
    import numpy as np
    from PIL import Image
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    geo = spec_mod._geometry(model)
    ip = LlavaOnevisionImageProcessorPil(
        size={"height": F.TILE, "width": F.TILE}, image_grid_pinpoints=F.PINPOINTS
    )
    rng = np.random.default_rng(0)
    for h, w in [(112, 80), (56, 150), (168, 168), (100, 112)]:
        assert fitted_size(h, w, geo.size_for((h, w))) == (h, w)
        raw = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        pv = ip([[Image.fromarray(raw)]], return_tensors="pt")["pixel_values"][0]
        mean, std = torch.tensor(anyres_pixels.MEAN), torch.tensor(anyres_pixels.STD)
        norm = (torch.from_numpy(raw).permute(2, 0, 1) / 255 - mean[:, None, None]) / std[
            :, None, None
        ]
        stitched = anyres_pixels.stitch(geo, pv, h, w)
        torch.testing.assert_close(stitched, norm, atol=1e-5, rtol=0)
        tiles = anyres_pixels.tiles_for(geo, stitched)
        assert tiles.shape == pv.shape
        torch.testing.assert_close(tiles[1:], pv[1:], atol=1e-5, rtol=0)
        assert (tiles[0] - pv[0]).abs().mean() < 0.1  # torch vs PIL bicubic on the base tile


def test_set_items_names_the_sample_id(model, tmp_path):
    items = [
        MediaItem(0, sample=0, modality="image", sample_id="a"),
        MediaItem(0, sample=1, modality="image", sample_id="b"),
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(
            model, [ALL, [img(56, 56, tokens=N56 - 1)]], GuardConfig(log_dir=str(tmp_path)), items
        )
