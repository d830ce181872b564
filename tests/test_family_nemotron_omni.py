"""install_vlm on transformers' real ``NemotronH_Omni_Reasoning_V3`` (tiny random config, CPU):
images (RADIO patch rows), video tubelets on the same image token, Parakeet audio.

Inputs come from ``testing/families/nemotron_omni.py`` (the image processor imports
torchvision: patch rows from its own ``convert_image_to_patches`` / ``get_patch_grid_size``).
Every guarded sample is compared with the same sample's plain forward in a batch of its own
(``family_checks.own_logits``: by hand beside a video). Aligned batches of every modality mix:
``tests/families/``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import aud, guarded_forward, img, own_logits, records, vid

from megatron_media_guard import GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.geometry import RadioTilerGeometry

pytest.importorskip("transformers.models.nemotron_h_omni")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.families import layouts
from megatron_media_guard.families import nemotron_omni as spec_mod
from megatron_media_guard.testing.families import nemotron_omni as F

TOKENS = {"<img>": F.IMG_START, "</img>": F.IMG_END, "<so_start>": F.SO_START, "<so_end>": F.SO_END}
IMG, IMG2, VID, AUD = img(4, 4), img(2, 4), vid(4, 4, 4), aud(40)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model()


def guarded(model, samples, config=None, items=None):
    return guarded_forward(F, model, samples, config, items, TOKENS)


def test_repair_reencodes_the_shrunk_image_at_the_engines_grid(model, tmp_path):
    """The seed's case in small: the trainer's grid 8x12 (24 features), the engine's run 12."""
    geo = RadioTilerGeometry(min_num_patches=16, max_num_patches=4096)
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    guard = MediaGuard(cfg, grammar=spec_mod.SPEC.grammar(model, TOKENS), geometry=geo)
    samples = [[img(8, 12, n=12)], [IMG2]]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [MediaItem(0, sample=0, source_hw=(8 * 16, 12 * 16)), MediaItem(0, sample=1)]
    b, out, res = guarded(model, samples, guard, source)
    assert res.report.actions == ("repair", "keep")
    rec = next(r for r in records(tmp_path) if r["event"] == "repair")
    assert (rec["fidelity"], rec["grid"]) == ("engine-replay", [6, 8])
    # the same image resized to 6x8 patches by hand and fed to the plain model
    rows = b.kwargs["pixel_values"][: 8 * 12]
    image = layouts.patches_to_image(rows, 8, 12)[None]
    small = torch.nn.functional.interpolate(
        image, size=(96, 128), mode="bicubic", antialias=True, align_corners=False
    )[0]
    fixed = dict(b.kwargs)
    fixed["pixel_values"] = torch.cat(
        [layouts.image_to_patches(small), b.kwargs["pixel_values"][96:]]
    )
    fixed["image_grid_hw"] = torch.tensor([[6, 8], [2, 4]])
    with torch.no_grad():
        ref = model(**fixed).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def test_equal_length_image_and_tubelets_need_set_items_in_token_order(model):
    samples = [[VID, IMG], [IMG2]]  # tubelets of 4 and an image of 4: the order is open
    with pytest.raises(MediaInputError, match="token order"):
        guarded(model, samples)
    items = [
        MediaItem(0, sample=0, modality="video"),
        MediaItem(0, sample=0, modality="image"),
        MediaItem(0, sample=1, modality="image"),
    ]
    b, out, _ = guarded(model, samples, items=items)
    for k, s in enumerate(samples):
        want = own_logits(F, model, s)
        torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)


def test_set_items_modality_is_checked(model):
    with pytest.raises(MediaInputError, match="modality 'audio'"):
        guarded(model, [[IMG], [IMG2]], items=[MediaItem(0, modality="audio")] * 2)


@pytest.fixture(scope="module")
def evs_model():
    return F.tiny_model(video_pruning_rate=0.5)


@pytest.mark.parametrize(
    "samples, plain",
    [([[VID], [VID]], True), ([[VID], [AUD]], False)],
    ids=["equal pruning", "unequal pruning"],
)
def test_evs_prunes_each_row_as_its_own_forward(evs_model, samples, plain):
    """Rows that prune the same count (4 tokens each): the plain forward (each row its own
    pruned forward). Unequal ones (4 from row 0 only, the total still divisible by 2): the
    plain forward's ``view(batch, -1)`` silently gives row 0 the first two tokens of row 1 and
    shifts row 1 by two; the guard gives each row its own forward, the shorter one padded."""
    b = F.make_batch(evs_model, samples)
    with install_vlm(evs_model, GuardConfig(), tokenizer=TOKENS), torch.no_grad():
        out = evs_model(**b.kwargs).logits
    unguarded = F.plain_logits(evs_model, b)
    assert unguarded.shape[1] == b.input_ids.shape[1] - (4 if plain else 2)
    if plain:
        torch.testing.assert_close(out, unguarded, atol=1e-6, rtol=1e-6)
    for k, s in enumerate(samples):
        want = F.plain_logits(evs_model, F.make_batch(evs_model, [s]))[0]
        torch.testing.assert_close(out[k, : want.shape[0]], want, atol=1e-5, rtol=1e-5)
    if not plain:
        assert (unguarded[1, :5] - want[:5]).abs().max() > 1e-3
