"""install_vlm on transformers' real ``InternVLForConditionalGeneration`` (tiny random config,
CPU): tiles of ``image_seq_length`` features, images' and video frames' tiles in one
``pixel_values`` on one token, tiles per image never reaching the model.

With ``set_items`` (one item per image, ``SEQ`` * its tiles, and one per video frame) every
fault is caught per sample; without them the engine cuts the one block of tile features by the
runs and says, in a ``check`` record, that only the total was checked.

Inputs from ``testing/families/internvl.py`` (transformers' real ``GotOcr2ImageProcessorPil``).
Comparisons on the final hidden states (``logits_to_keep=1``; a hook on ``model.model``). The
fixture's own layout and tile counts come first; the plain class under the faults:
``tests/test_fixture_plain.py``; the shared contract: ``tests/families/``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import decoder_inputs, raised_samples, records
from family_checks import hidden_forward as forward

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.core.host import count_transfers

pytest.importorskip("transformers.models.internvl")
pytest.importorskip("PIL")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.testing.families import internvl as F
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)
TOKENS = {"<img>": F.IMG_START, "</img>": F.IMG_END}
ONE, WIDE, TALL = M("image", (56, 56)), M("image", (56, 112)), M("image", (100, 40))
VID = M("video", (3,))
CHECK = "only the total was checked"


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def test_batch_layout(model):
    b = F.make_batch(model, [[WIDE, VID], [ONE, TALL]])
    # tiles: WIDE 2 + thumbnail, VID 3 frames, ONE 1, TALL 3 + thumbnail
    assert b.kwargs["pixel_values"].shape == (3 + 3 + 1 + 4, 3, F.TILE, F.TILE)
    assert b.items == [(0, "image", 12), (0, "video", 12), (1, "image", 4), (1, "image", 16)]
    assert b.runs == [
        [("image", 12), ("video", 4), ("video", 4), ("video", 4)],
        [("image", 4), ("image", 16)],
    ]
    assert set(b.kwargs) == {"input_ids", "attention_mask", "pixel_values"}  # no tile counts


@pytest.mark.parametrize("hw", [(56, 56), (56, 112), (100, 40), (60, 300), (90, 100)])
def test_tile_counts_are_the_processors_and_the_geometrys(model, hw):
    from megatron_media_guard.geometry.tiled import TiledGeometry

    b = F.make_batch(model, [[M("image", hw)]])
    geo = TiledGeometry(tile=F.TILE, tokens_per_tile=F.SEQ, max_tiles=F.MAX_TILES)
    assert b.items[0][2] == geo.tokens(hw)


def own(model, sample):
    b = F.make_batch(model, [[M(m.modality, m.size) for m in sample]])
    return F.plain_hidden(model, b)[0, : b.lengths[0]]


def items_of(b) -> list[MediaItem]:
    """What a collate that kept the processor's ``num_patches`` would give ``set_items``: per
    tile block in ``pixel_values`` order, its sample and one item per image (SEQ x its tiles)
    or per video frame (SEQ), all of the model's one modality. After a swap a block keeps its
    place (its sample) and brings its tiles (``FamilyBatch.items``)."""
    out = []
    for s, mod, n in b.items:
        sizes = [n] if mod == "image" else [F.SEQ] * (n // F.SEQ)
        out += [MediaItem(x, sample=s, modality="image") for x in sizes]
    return out


def guarded(model, samples, config=None, items=True, labels=False, **kw):
    b = F.make_batch(model, samples, **kw)
    call = dict(b.kwargs, labels=b.input_ids.clone()) if labels else b.kwargs
    with install_vlm(model, config or GuardConfig(), tokenizer=TOKENS) as h:
        if items:
            h.set_items(items_of(b))
        hidden, out = forward(model, call)
        return b, hidden, out, h.last_result


ALIGNED = {
    "images": [[WIDE, ONE], [TALL]],
    "video": [[VID], [M("video", (2,))]],
    "mixed image+video": [[WIDE, VID], [ONE, TALL]],
}


@pytest.mark.parametrize("given", [True, False], ids=["set_items", "runs"])
@pytest.mark.parametrize("name", list(ALIGNED))
def test_aligned_batches_equal_the_plain_model(model, name, given, tmp_path):
    """With ``set_items``: bit for bit, one transfer; cut by the runs: the record says so."""
    cfg = GuardConfig(log_dir=str(tmp_path))
    with count_transfers() as n:
        b, hidden, _, res = guarded(model, ALIGNED[name], cfg, items=given)
    assert res.report.actions == ("keep",) * len(ALIGNED[name])
    torch.testing.assert_close(hidden, F.plain_hidden(model, b), atol=1e-6, rtol=1e-6)
    if given:
        assert torch.equal(hidden, F.plain_hidden(model, b)) and sum(n.values()) == 1, n
    checks = [r for r in records(tmp_path) if r["event"] == "check"]
    assert bool(checks) is not given  # cut by the runs: said so
    assert all(CHECK in r["reason"] for r in checks)


# (name, samples, swap, bad samples, a kept sample); unguarded, all but the short run are
# silent with features in the wrong sample (tests/test_fixture_plain.py)
# (a short run and +k/-k across images: tests/families/)
FAULTS = [
    ("+k/-k image and video frame", [[M("image", (56, 56), tokens=5)],
                                     [M("video", (2,), tokens=7)], [ONE]], None, {0, 1}, 2),
    ("swap of tile counts", [[WIDE], [ONE], [TALL]], (0, 1), {0, 1}, 2),
    ("swap image and video", [[ONE], [VID], [WIDE]], (0, 1), {0, 1}, 2),
]  # fmt: skip


@pytest.mark.parametrize("name,samples,swap,bad,kept", FAULTS, ids=[f[0] for f in FAULTS])
def test_raise_names_the_sample(model, name, samples, swap, bad, kept, tmp_path):
    cfg = GuardConfig(log_dir=str(tmp_path))
    assert raised_samples(lambda: guarded(model, samples, cfg, swap=swap), bad, tmp_path) == bad


@pytest.mark.parametrize("name,samples,swap,bad,kept", FAULTS, ids=[f[0] for f in FAULTS])
def test_drop_keeps_every_other_sample_equal_to_its_own_forward(
    model, name, samples, swap, bad, kept
):
    cfg = GuardConfig(policy="drop")
    emb, (b, hidden, out, res) = decoder_inputs(
        model.model.language_model, lambda: guarded(model, samples, cfg, labels=True, swap=swap)
    )
    assert {s for s, a in enumerate(res.report.actions) if a == "drop"} == bad
    torch.testing.assert_close(hidden[kept, : b.lengths[kept]], own(model, samples[kept]))
    text = model.get_input_embeddings()(b.input_ids)
    for k in bad:
        assert torch.equal(emb[k], text[k])  # no feature in a dropped sample's row
        assert (res.labels[k] == -100).all()
    assert torch.isfinite(out.loss)


def test_without_set_items_only_the_total_is_checked(model, tmp_path):
    """A net short run still raises (the total is off; the blame falls on the last run, which
    takes what is left); a +k/-k keeps every sample, and the record says why it could not see."""
    cfg = GuardConfig(log_dir=str(tmp_path))
    with pytest.raises(MediaAlignmentError):
        guarded(model, [[M("image", (56, 112), tokens=10)], [ONE]], cfg, items=False)
    plus_minus = [[M("image", (56, 56), tokens=6)], [M("image", (56, 112), tokens=10)], [TALL]]
    res = guarded(model, plus_minus, cfg, items=False)[3]
    assert res.report.actions == ("keep",) * 3
    assert any(CHECK in r["reason"] for r in records(tmp_path) if r["event"] == "check")
