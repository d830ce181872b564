"""install_vlm on transformers' real ``NemotronH_Omni_Reasoning_V3`` (tiny random config, CPU):
images (RADIO patch rows), video tubelets on the same image token, Parakeet audio.

Inputs come from ``testing/families/nemotron_omni.py`` (the image processor imports
torchvision: patch rows from its own ``convert_image_to_patches`` / ``get_patch_grid_size``).
Every guarded sample is compared with the same sample's plain forward in a batch of its own.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import records

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.geometry import RadioTilerGeometry

pytest.importorskip("transformers.models.nemotron_h_omni")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.families import layouts
from megatron_media_guard.families import nemotron_omni as spec_mod
from megatron_media_guard.testing.families import nemotron_omni as F
from megatron_media_guard.testing.families.base import Media

TOKENS = {"<img>": F.IMG_START, "</img>": F.IMG_END, "<so_start>": F.SO_START, "<so_end>": F.SO_END}
IMG, IMG2 = Media("image", (4, 4)), Media("image", (2, 4))
VID, AUD = Media("video", (4, 4, 4)), Media("audio", (40,))


@pytest.fixture(scope="module")
def model():
    return F.tiny_model()


def plain(model, samples, **kw):
    return F.plain_logits(model, F.make_batch(model, samples, **kw))


def own(model, sample):
    """Logits of ``sample`` in a batch of its own, plain model: ``[len, vocab]``. A sample with
    both images and videos the plain model cannot take: its features are then placed by hand,
    run by run in token order, and the language model runs on the result."""
    b = F.make_batch(model, [sample])
    mods = {m.modality for m in sample}
    if not {"image", "video"} <= mods:
        return F.plain_logits(model, b)[0, : b.lengths[0]]
    kw = b.kwargs
    with torch.no_grad():
        img = model.get_image_features(kw["pixel_values"], kw["image_grid_hw"]).pooler_output
        vid = model.get_video_features(kw["pixel_values_videos"]).pooler_output
        per = vid[0].shape[0] // kw["pixel_values_videos"].shape[1]
        queue = {"image": list(img), "video": [g for v in vid for g in v.split(per)]}
        emb = model.get_input_embeddings()(b.input_ids)
        pos = (b.input_ids[0] == F.IMAGE).nonzero().flatten().tolist()
        at = 0
        for mod, n in b.runs[0]:
            f = queue[mod].pop(0)
            assert f.shape[0] == n
            emb[0, pos[at : at + n]] = f
            at += n
        out = model.language_model(inputs_embeds=emb, attention_mask=kw["attention_mask"])
    return out.logits[0, : b.lengths[0]]


def guarded(model, samples, config=None, items=None, guard=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, guard or config or GuardConfig(), tokenizer=TOKENS) as h:
        if items is not None:
            h.set_items(items)
        with torch.no_grad():
            out = model(**b.kwargs)
        return b, out, h.last_result


# ref "batch": the plain model takes the batch, the guarded one must equal it; "own": it cannot
# (images and videos together), each sample must equal its own plain forward. Two audio clips
# of different lengths differ from their own forwards in the plain model too (the tower sees
# the padding), so they are compared with the plain batch.
ALIGNED = [
    ("image", [[IMG], [IMG2]], "batch"),
    ("video", [[VID], [VID]], "batch"),
    ("audio", [[AUD], [Media("audio", (24,))]], "batch"),
    ("image+audio", [[AUD, IMG], [IMG2]], "batch"),
    ("image+video one sample", [[IMG2, VID], [IMG]], "own"),
    ("video then image", [[VID, IMG2], [AUD, IMG]], "own"),
    ("every modality", [[IMG], [VID], [AUD, IMG2]], "own"),
]


@pytest.mark.parametrize("name,samples,ref", ALIGNED, ids=[n for n, _, _ in ALIGNED])
def test_aligned_batches_equal_the_plain_model(model, name, samples, ref):
    b, out, res = guarded(model, samples)
    assert res.report.actions == ("keep",) * len(samples)
    if ref == "batch":
        torch.testing.assert_close(out.logits, plain(model, samples), atol=1e-6, rtol=1e-6)
        return
    for k, s in enumerate(samples):
        want = own(model, s)
        torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)


def test_plain_model_cannot_take_a_mixed_image_video_batch(model):
    with pytest.raises(Exception, match="feature vectors for"):
        plain(model, [[IMG], [VID]])


def test_swap_drop_feeds_no_feature_to_the_dropped_rows(model):
    samples = [[IMG], [Media("image", (2, 2))]]
    b = F.make_batch(model, samples, swap=(0, 1))
    seen = []
    hook = model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].detach().clone()), with_kwargs=True
    )
    try:
        h = install_vlm(model, GuardConfig(policy="drop"), tokenizer=TOKENS)
        with h, torch.no_grad():
            model(**b.kwargs)
    finally:
        hook.remove()
    assert h.last_result.report.actions == ("drop", "drop")
    text = model.get_input_embeddings()(b.input_ids)
    assert torch.equal(seen[0], text)  # every placeholder kept its own token's embedding


def test_repair_reencodes_the_shrunk_image_at_the_engines_grid(model, tmp_path):
    """The seed's case in small: the trainer's grid 8x12 (24 features), the engine's run 12."""
    geo = RadioTilerGeometry(min_num_patches=16, max_num_patches=4096)
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))
    guard = MediaGuard(cfg, grammar=spec_mod.SPEC.grammar(model, TOKENS), geometry=geo)
    samples = [[Media("image", (8, 12), tokens=12)], [IMG2]]
    # the original's size (the engine sized it): a frame alone would be a guess, not a replay
    source = [MediaItem(0, sample=0, source_hw=(8 * 16, 12 * 16)), MediaItem(0, sample=1)]
    b, out, res = guarded(model, samples, guard=guard, items=source)
    assert res.report.actions == ("repair", "keep")
    rec = next(r for r in records(tmp_path) if r["event"] == "repair")
    assert (rec["fidelity"], rec["grid"]) == ("engine-replay", [6, 8])
    # the same image resized to 6x8 patches by hand and fed to the plain model
    rows = b.kwargs["pixel_values"][: 8 * 12]
    img = layouts.patches_to_image(rows, 8, 12)[None]
    small = torch.nn.functional.interpolate(
        img, size=(96, 128), mode="bicubic", antialias=True, align_corners=False
    )[0]
    fixed = dict(b.kwargs)
    fixed["pixel_values"] = torch.cat(
        [layouts.image_to_patches(small), b.kwargs["pixel_values"][96:]]
    )
    fixed["image_grid_hw"] = torch.tensor([[6, 8], [2, 4]])
    with torch.no_grad():
        ref = model(**fixed).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def test_set_items_names_sample_ids_and_shares_a_video_across_its_tubelets(model, tmp_path):
    samples = [[VID], [Media("video", (4, 4, 4), tokens=7)]]
    items = [
        MediaItem(0, sample=0, modality="video", sample_id="a"),
        MediaItem(0, sample=1, modality="video", sample_id="b"),
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), items=items)


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
        want = own(model, s)
        torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)


def test_set_items_count_and_modality_are_checked(model):
    with pytest.raises(MediaInputError, match="set_items gave 1 items"):
        guarded(model, [[IMG], [IMG2]], items=[MediaItem(0, modality="image")])
    with pytest.raises(MediaInputError, match="modality 'audio'"):
        guarded(model, [[IMG], [IMG2]], items=[MediaItem(0, modality="audio")] * 2)


def test_missing_markers_name_the_tokens(model):
    with pytest.raises(MediaInputError, match="'<img>'"):
        install_vlm(model, GuardConfig())


def test_unknown_model_lists_the_families():
    with pytest.raises(MediaInputError, match="nemotron_omni"):
        install_vlm(torch.nn.Linear(2, 2), GuardConfig())


@pytest.mark.parametrize("mode", ["text", "drop"])
def test_a_generated_placeholder_is_fed_as_text(model, mode):
    """An ``<image>`` the policy wrote in its response (under the labels, outside every region):
    kept and fed the family's text token by default; dropped on request."""
    b = F.make_batch(model, [[IMG], [IMG2]])
    pos = b.lengths[1] - 2
    b.kwargs["input_ids"][1, pos] = F.IMAGE
    labels = b.input_ids.clone()
    labels[b.kwargs["attention_mask"] == 0] = -100
    h = install_vlm(model, GuardConfig(policy="drop", generated=mode), tokenizer=TOKENS)
    with h, torch.no_grad():
        out = model(**b.kwargs, labels=labels)
    res = h.last_result
    if mode == "drop":
        assert res.report.actions == ("keep", "drop")
        return
    assert res.report.actions == ("keep", "keep")
    assert res.report.generated == ((1, (pos,)),)
    fixed = dict(b.kwargs)
    fixed["input_ids"] = b.input_ids.clone()
    fixed["input_ids"][1, pos] = F.PAD  # the config's pad token: the family's text id
    with torch.no_grad():
        ref = model(**fixed, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss)


@pytest.fixture(scope="module")
def evs_model():
    return F.tiny_model(video_pruning_rate=0.5)


def test_evs_prunes_as_the_plain_model_does(evs_model):
    samples = [[VID], [Media("video", (4, 4, 4))]]
    b = F.make_batch(evs_model, samples)
    with install_vlm(evs_model, GuardConfig(), tokenizer=TOKENS), torch.no_grad():
        out = evs_model(**b.kwargs).logits
    ref = F.plain_logits(evs_model, b)
    assert out.shape == ref.shape and out.shape[1] < b.input_ids.shape[1]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_evs_rows_of_unequal_length_are_padded_not_shifted(evs_model):
    """The plain forward's ``view(batch, -1)`` moves tokens between rows when one row prunes
    more than another; guarded, each row equals its own forward (the shorter one padded)."""
    samples = [[VID], [AUD]]
    b = F.make_batch(evs_model, samples)
    with install_vlm(evs_model, GuardConfig(), tokenizer=TOKENS), torch.no_grad():
        out = evs_model(**b.kwargs).logits
    for k, s in enumerate(samples):
        alone = F.make_batch(evs_model, [s])
        want = F.plain_logits(evs_model, alone)[0]
        torch.testing.assert_close(out[k, : want.shape[0]], want, atol=1e-5, rtol=1e-5)


def test_check_batch_before_the_trainer_drops_the_bad_sample_without_a_model(model):
    """The spec's own arithmetic on the processor's outputs (no model, no tower): the sample
    whose run is short loses its media and its placeholders become text; the rest is as given,
    and the checked batch then runs through the plain model."""
    from megatron_media_guard.families.collate import check_batch

    b = F.make_batch(model, [[IMG, AUD], [Media("image", (4, 4), tokens=3)], [IMG2]])
    checked = check_batch("nemotron_omni", b.kwargs, config=model.config, tokenizer=TOKENS)
    assert checked.report.actions == ("keep", "drop", "keep")
    out = checked.batch
    assert out["image_grid_hw"].tolist() == [[4, 4], [2, 4]]
    assert out["pixel_values"].shape[0] == 16 + 8
    assert not (out["input_ids"][1] == F.IMAGE).any()
    assert torch.equal(out["input_ids"][0], b.input_ids[0])
    with torch.no_grad():
        got = model(**out).logits
    for k in (0, 2):
        want = own(model, [[IMG, AUD], None, [IMG2]][k])
        torch.testing.assert_close(got[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)


def test_check_batch_leaves_an_aligned_batch_as_it_is(model):
    from megatron_media_guard.families.collate import check_batch

    b = F.make_batch(model, [[IMG], [VID], [AUD]])
    checked = check_batch("nemotron_omni", b.kwargs, config=model.config, tokenizer=TOKENS)
    assert checked.report.actions == ("keep",) * 3 and checked.dropped == ()
    assert all(checked.batch[k] is v for k, v in b.kwargs.items())
