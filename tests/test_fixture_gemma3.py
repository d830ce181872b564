"""The Gemma 3 fixture against the real transformers class (tiny random config, CPU) and its real
PIL image processor: aligned batches (with and without pan-and-scan crops) equal each sample's
own forward (final hidden states; the logits are their ``lm_head``), and the unguarded behaviour
under a short run, +k/-k and a swap, as measured."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard.testing.families import gemma3 as F
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


WIDE, TALL, SQUARE = M("image", (20, 64)), M("image", (40, 30)), M("image", (32, 32))
SAMPLES = [[TALL, SQUARE], [WIDE]]


def own(model, sample, **kw):
    b = F.make_batch(model, [sample], **kw)
    return F.plain_hidden(model, b)[0]


@pytest.mark.parametrize("pan_and_scan", [False, True], ids=["plain", "pan-and-scan"])
def test_aligned_each_sample_equals_its_own_forward(model, pan_and_scan):
    batch = F.make_batch(model, SAMPLES, pan_and_scan=pan_and_scan)
    hidden = F.plain_hidden(model, batch)
    for k, sample in enumerate(SAMPLES):
        n = batch.lengths[k]
        torch.testing.assert_close(
            hidden[k, :n], own(model, sample, pan_and_scan=pan_and_scan), atol=1e-5, rtol=0
        )


def test_pan_and_scan_crops_are_extra_images_after_their_original(model):
    """40x30 -> 2 crops, 32x32 -> none, 20x64 -> 3: the processor's ``num_crops``, which the
    processor pops; each crop is one more pixel row and one more full run."""
    batch = F.make_batch(model, SAMPLES, pan_and_scan=True)
    from PIL import Image

    out = F.image_processor(True)(images=[Image.new("RGB", (64, 20))], return_tensors="pt")
    assert out["num_crops"].tolist() == [3]
    assert batch.kwargs["pixel_values"].shape == (8, 3, 32, 32)
    assert [len(r) for r in batch.runs] == [4, 4]
    assert batch.items == [(0, "image", 4)] * 4 + [(1, "image", 4)] * 4
    ids = batch.input_ids
    assert int((ids == F.BOI).sum()) == int((ids == F.EOI).sum()) == 8
    assert torch.equal(batch.kwargs["token_type_ids"] == 1, ids == F.IMAGE)


def test_token_type_ids_matter(model):
    """They make each image block attend bidirectionally: without them the output changes, so a
    rewrite of the ids must rewrite them too."""
    b = F.make_batch(model, SAMPLES)
    kw = dict(b.kwargs)
    kw.pop("token_type_ids")
    with torch.no_grad():
        without = model.model(**kw).last_hidden_state
    assert (without - F.plain_hidden(model, b)).abs().max() > 1e-3


def test_plain_logits_are_lm_head_of_plain_hidden(model):
    b = F.make_batch(model, [[SQUARE]])
    with torch.no_grad():
        want = model.lm_head(F.plain_hidden(model, b))
    torch.testing.assert_close(F.plain_logits(model, b), want)


# ---- unguarded, measured ------------------------------------------------------------------


@pytest.mark.parametrize("k", [3, 5])
def test_unguarded_short_or_long_run_raises_naming_no_sample(model, k):
    with pytest.raises(
        ValueError, match=rf"Image features and image tokens do not match, tokens: {k}, features: 4"
    ):
        F.plain_hidden(model, F.make_batch(model, [[M("image", (32, 32), tokens=k)]]))


SILENT = {
    # sample 0's surplus takes image 1's first 2 features; sample 1's 2 placeholders its last 2
    "+k/-k": ([[M("image", (32, 32), tokens=6)], [M("image", (20, 64), tokens=2)]], None, 1),
    "swap between samples": (SAMPLES, (0, 2), 0),
    "swap within a sample": ([[TALL, SQUARE]], (0, 1), 0),
}


def _aligned(sample):
    return [M(m.modality, m.size) for m in sample]


@pytest.mark.parametrize("name", list(SILENT))
def test_unguarded_runs_silently_with_features_in_the_wrong_place(model, name):
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
