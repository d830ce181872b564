"""install_vlm on transformers' real ``Gemma3ForConditionalGeneration`` (tiny random config, CPU):
a fixed count per pixel row, pan-and-scan crops as extra rows, ``token_type_ids`` that make each
image block attend bidirectionally (a drop must rewrite them with the ids).

Inputs from ``testing/families/gemma3.py`` (transformers' real ``Gemma3ImageProcessorPil``).
Comparisons are on the final hidden states (the 262k vocabulary dominates CPU time). The plain
class under the faults: ``tests/test_fixture_plain.py``; the shared contract:
``tests/families/``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import decoder_inputs, img, raised_samples
from family_checks import hidden_forward as forward

from megatron_media_guard import GuardConfig
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.geometry import FixedGeometry

pytest.importorskip("transformers.models.gemma3")
pytest.importorskip("PIL")

from megatron_media_guard.adapters import install_vlm
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


def own(model, sample, **kw):
    b = F.make_batch(model, [sample], **kw)
    return F.plain_hidden(model, b)[0, : b.lengths[0]]


def guarded(model, samples, config=None, labels=False, **kw):
    b = F.make_batch(model, samples, **kw)
    call = dict(b.kwargs, labels=b.input_ids.clone()) if labels else b.kwargs
    with install_vlm(model, config or GuardConfig()) as h:
        hidden, out = forward(model, call)
        return b, hidden, out, h.last_result


def test_an_aligned_call_with_pan_and_scan_crops_is_the_plain_model_with_one_transfer(model):
    """Bit for bit, each sample its own forward, the one transfer of the guard's verdict."""
    samples = [[TALL, SQUARE], [WIDE]]
    b = F.make_batch(model, samples, pan_and_scan=True)
    ref = F.plain_hidden(model, b)
    with install_vlm(model, GuardConfig()) as h, count_transfers() as n:
        hidden, _ = forward(model, b.kwargs)
    assert h.last_result.report.actions == ("keep",) * len(samples)
    assert torch.equal(hidden, ref)
    assert sum(n.values()) == 1, n
    for k, s in enumerate(samples):
        want = own(model, s, pan_and_scan=True)
        torch.testing.assert_close(hidden[k, : b.lengths[k]], want, atol=1e-5, rtol=0)


# the plain model raises on it (tests/test_fixture_plain.py); the shared faults without crops,
# +k/-k among them: tests/families/
SHORT = [[WIDE], [img(20, 64, n=3)]]  # sample 1's first run short, crops after it


def test_a_short_run_before_a_crop_raises_naming_the_sample(model, tmp_path):
    run = lambda: guarded(model, SHORT, GuardConfig(log_dir=str(tmp_path)), pan_and_scan=True)  # noqa: E731
    assert raised_samples(run, 1, tmp_path) == {1}


def test_a_dropped_sample_gets_no_feature_and_no_image_block(model):
    """Its row holds its tokens' embeddings and its bidirectional blocks (``token_type_ids``,
    which matter) went with its soft tokens: the plain model on that text, no pixel rows; the
    other sample is its own forward."""
    cfg = GuardConfig(policy="drop")
    emb, (b, hidden, out, res) = decoder_inputs(
        model.model.language_model,
        lambda: guarded(model, SHORT, cfg, labels=True, pan_and_scan=True),
    )
    assert res.report.actions == ("keep", "drop")
    want = own(model, SHORT[0], pan_and_scan=True)
    torch.testing.assert_close(hidden[0, : b.lengths[0]], want)
    ids, attn = b.input_ids[1:], b.kwargs["attention_mask"][1:]
    assert torch.equal(emb[1], model.get_input_embeddings()(ids)[0])
    with torch.no_grad():
        want = model.model(input_ids=ids, attention_mask=attn, token_type_ids=ids * 0)
        blocks = model.model(
            input_ids=ids, attention_mask=attn, token_type_ids=(ids == F.IMAGE).long()
        )
    torch.testing.assert_close(hidden[1], want.last_hidden_state[0], atol=1e-5, rtol=1e-5)
    assert (hidden[1] - blocks.last_hidden_state[0]).abs().max() > 1e-3
    assert (res.labels[1] == -100).all()
    assert torch.isfinite(out.loss)


def test_an_equal_size_swap_is_invisible_to_every_count(model):
    """Every row has mm features: a swap changes no count, for the plain model and the guard
    alike (the guard keeps the batch; nothing in the inputs tells the rows apart)."""
    b, hidden, _, res = guarded(model, [[TALL, SQUARE], [WIDE]], swap=(0, 2))
    assert res.report.actions == ("keep", "keep")
    torch.testing.assert_close(hidden, F.plain_hidden(model, b), atol=1e-6, rtol=1e-6)


def test_the_repair_geometry_is_the_fixed_count_at_the_towers_size(model):
    """No resize reaches another count: every repair falls back (tests/families/)."""
    g = guard_for(spec_mod.SPEC, model, GuardConfig(policy="repair"))
    assert g.geometry == FixedGeometry(F.MM_TOKENS, (F.IMAGE_SIZE, F.IMAGE_SIZE))
