"""The InternVL fixture against the real transformers class (tiny random config, CPU) and the
real GotOcr2 PIL image processor: aligned batches (images, video, mixed) equal each sample's own
forward (final hidden states; the logits are their ``lm_head``), tile counts agree with the
geometry, and the unguarded behaviour under a short run, +k/-k and a swap, as measured."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard.testing.families import internvl as F
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


ONE, WIDE, TALL = M("image", (56, 56)), M("image", (56, 112)), M("image", (100, 40))
VID = M("video", (3,))

ALIGNED = {
    "images": [[WIDE, ONE], [TALL]],
    "video": [[VID], [M("video", (2,))]],
    "mixed image+video": [[WIDE, VID], [ONE, TALL]],
}


@pytest.mark.parametrize("name", list(ALIGNED))
def test_aligned_each_sample_equals_its_own_forward(model, name):
    samples = ALIGNED[name]
    batch = F.make_batch(model, samples)
    hidden = F.plain_hidden(model, batch)
    for k, sample in enumerate(samples):
        own = F.make_batch(model, [sample])
        torch.testing.assert_close(
            hidden[k, : batch.lengths[k]], F.plain_hidden(model, own)[0], atol=1e-5, rtol=0
        )


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


def test_plain_logits_are_lm_head_of_plain_hidden(model):
    b = F.make_batch(model, [[ONE]])
    with torch.no_grad():
        want = model.lm_head(F.plain_hidden(model, b))
    torch.testing.assert_close(F.plain_logits(model, b), want)


# ---- unguarded, measured ------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample,k,n",
    [([M("image", (56, 56), tokens=3)], 3, 4), ([M("video", (3,), tokens=13)], 13, 12)],
    ids=["short image", "surplus video"],
)
def test_unguarded_total_mismatch_raises_naming_no_sample(model, sample, k, n):
    with pytest.raises(
        ValueError,
        match=rf"Image features and image tokens do not match, tokens: {k}, features: {n}",
    ):
        F.plain_hidden(model, F.make_batch(model, [sample]))


SILENT = {
    # sample 0's surplus takes image 1's first 2 features; sample 1's run starts at its third
    "+k/-k images": (
        [[M("image", (56, 56), tokens=6)], [M("image", (56, 112), tokens=10)]],
        None,
        1,
    ),
    "+k/-k image/video frame": (
        [[M("image", (56, 56), tokens=8)], [M("video", (3,), tokens=8)]],
        None,
        1,
    ),
    "swap images of different tile counts": ([[WIDE], [TALL]], (0, 1), 0),
    "swap image and video": ([[WIDE], [VID]], (0, 1), 0),
}


def _aligned(sample):
    return [M(m.modality, m.size) for m in sample]


@pytest.mark.parametrize("name", list(SILENT))
def test_unguarded_runs_silently_with_features_in_the_wrong_sample(model, name):
    samples, swap, victim = SILENT[name]
    batch = F.make_batch(model, samples, swap=swap)
    hidden = F.plain_hidden(model, batch)  # no error
    ref_batch = F.make_batch(model, [_aligned(samples[victim])])
    ref = F.plain_hidden(model, ref_batch)[0]
    a, b = batch.input_ids[victim], ref_batch.input_ids[0]
    n = min(len(a), len(b))
    same = int((a[:n] != b[:n]).nonzero()[0]) if (a[:n] != b[:n]).any() else n
    first = int((b == F.IMAGE).nonzero()[0])
    assert same > first
    torch.testing.assert_close(hidden[victim, :first], ref[:first], atol=1e-5, rtol=0)
    assert (hidden[victim, first:same] - ref[first:same]).abs().max() > 1e-3
