"""install_vlm on transformers' real ``Gemma3ForConditionalGeneration`` (tiny random config, CPU):
a fixed count per pixel row, pan-and-scan crops as extra rows, ``token_type_ids`` that make each
image block attend bidirectionally (a drop must rewrite them with the ids).

Inputs from ``testing/families/gemma3.py`` (transformers' real ``Gemma3ImageProcessorPil``).
Comparisons are on the final hidden states (the 262k vocabulary dominates CPU time). The plain
class under the faults: ``tests/test_fixture_plain.py``; the shared contract, aligned calls and
a short run before its crops included: ``tests/families/``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import guarded_forward, img
from family_checks import hidden_forward as forward

from megatron_media_guard import GuardConfig
from megatron_media_guard.geometry import FixedGeometry

pytest.importorskip("transformers.models.gemma3")
pytest.importorskip("PIL")

from megatron_media_guard.adapters.vlm_install import guard_for
from megatron_media_guard.families import gemma3 as spec_mod
from megatron_media_guard.testing.families import gemma3 as F

pytestmark = pytest.mark.timeout(120)

WIDE, TALL, SQUARE = img(20, 64), img(40, 30), img(32, 32)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def test_pan_and_scan_crops_are_extra_images_after_their_original(model):
    """40x30 -> 2 crops, 32x32 -> none, 20x64 -> 3: the processor's ``num_crops``, which the
    processor pops; each crop is one more pixel row and one more full run."""
    batch = F.make_batch(model, [[TALL, SQUARE], [WIDE]], pan_and_scan=True)
    from PIL import Image

    out = F.image_processor(True)(images=[Image.new("RGB", (64, 20))], return_tensors="pt")
    assert out["num_crops"].tolist() == [3]
    assert batch.kwargs["pixel_values"].shape == (8, 3, 32, 32)
    assert [len(r) for r in batch.runs] == [4, 4]
    assert batch.items == [(0, "image", 4)] * 4 + [(1, "image", 4)] * 4
    ids = batch.input_ids
    assert int((ids == F.BOI).sum()) == int((ids == F.EOI).sum()) == 8
    assert torch.equal(batch.kwargs["token_type_ids"] == 1, ids == F.IMAGE)


def test_a_dropped_samples_image_blocks_go_with_its_soft_tokens(model):
    """Its row is the plain model on its text with ``token_type_ids`` 0: its bidirectional
    blocks, which matter, went with its soft tokens. (No feature in its row, its labels
    ignored, the other sample its own forward: the contract, ``tests/families/``.)"""
    short = [[WIDE], [img(20, 64, n=3)]]  # sample 1's first run short, crops after it
    drop = GuardConfig(policy="drop")
    b, (hidden, _), res = guarded_forward(F, model, short, drop, run=forward, pan_and_scan=True)
    assert res.report.actions == ("keep", "drop")
    ids, attn = b.input_ids[1:], b.kwargs["attention_mask"][1:]
    with torch.no_grad():
        want = model.model(input_ids=ids, attention_mask=attn, token_type_ids=ids * 0)
        blocks = model.model(
            input_ids=ids, attention_mask=attn, token_type_ids=(ids == F.IMAGE).long()
        )
    torch.testing.assert_close(hidden[1], want.last_hidden_state[0], atol=1e-5, rtol=1e-5)
    assert (hidden[1] - blocks.last_hidden_state[0]).abs().max() > 1e-3


def test_an_equal_size_swap_is_invisible_to_every_count(model):
    """Every row has mm features: a swap changes no count, for the plain model and the guard
    alike (the guard keeps the batch; nothing in the inputs tells the rows apart)."""
    b, (hidden, _), res = guarded_forward(
        F, model, [[TALL, SQUARE], [WIDE]], run=forward, swap=(0, 2)
    )
    assert res.report.actions == ("keep", "keep")
    torch.testing.assert_close(hidden, F.plain_hidden(model, b), atol=1e-6, rtol=1e-6)


def test_the_repair_geometry_is_the_fixed_count_at_the_towers_size(model):
    """No resize reaches another count: every repair falls back (tests/families/)."""
    g = guard_for(spec_mod.SPEC, model, GuardConfig(policy="repair"))
    assert g.geometry == FixedGeometry(F.MM_TOKENS, (F.IMAGE_SIZE, F.IMAGE_SIZE))
