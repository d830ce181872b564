"""install_vlm on transformers' real ``Gemma3ForConditionalGeneration`` (tiny random config, CPU):
a fixed count per pixel row, pan-and-scan crops as extra rows, ``token_type_ids`` that make each
image block attend bidirectionally (a drop must rewrite them with the ids).

Inputs from ``testing/families/gemma3.py`` (transformers' real ``Gemma3ImageProcessorPil``).
Comparisons are on the final hidden states (``lm_head`` of them are the logits; the 262k
vocabulary dominates CPU time): the forward runs with ``logits_to_keep=1`` and a hook on
``model.model`` keeps its ``last_hidden_state``. The fixture's own checks (pan-and-scan crops,
``token_type_ids``, logits as ``lm_head`` of the hidden states) come first; the plain class
under the faults: ``tests/test_fixture_plain.py``; the shared contract: ``tests/families/``.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import decoder_inputs, raised_samples, records
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
from megatron_media_guard.testing.families.base import Media as M

pytestmark = pytest.mark.timeout(120)

WIDE, TALL, SQUARE = M("image", (20, 64)), M("image", (40, 30)), M("image", (32, 32))


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


def test_token_type_ids_matter(model):
    """They make each image block attend bidirectionally: without them the output changes, so a
    rewrite of the ids must rewrite them too."""
    b = F.make_batch(model, [[TALL, SQUARE], [WIDE]])
    kw = dict(b.kwargs)
    kw.pop("token_type_ids")
    with torch.no_grad():
        without = model.model(**kw).last_hidden_state
    assert (without - F.plain_hidden(model, b)).abs().max() > 1e-3


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
    samples = [[TALL, SQUARE], [WIDE]]
    b = F.make_batch(model, samples, pan_and_scan=True)
    ref = F.plain_hidden(model, b)
    with install_vlm(model, GuardConfig()) as h, count_transfers() as n:
        hidden, _ = forward(model, b.kwargs)
    assert h.last_result.report.actions == ("keep",) * len(samples)
    assert torch.equal(hidden, ref)
    assert sum(n.values()) == 1, n  # the guard's verdict


# (name, samples, bad samples, the kept sample); the plain model raises on a net short run
# and runs +k/-k silently with features in the wrong sample (tests/test_fixture_plain.py);
# the shared faults without crops: tests/families/
FAULTS = [
    (
        "+k/-k",
        [[M("image", (32, 32), tokens=6)], [M("image", (20, 64), tokens=2)], [TALL]],
        {0, 1},
        2,
    ),
    ("short run before a crop", [[WIDE], [M("image", (20, 64), tokens=3)]], {1}, 0),
]


def test_a_short_run_before_a_crop_raises_naming_the_sample(model, tmp_path):
    _, samples, bad, _ = FAULTS[-1]
    run = lambda: guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), pan_and_scan=True)  # noqa: E731
    assert raised_samples(run, bad, tmp_path) >= bad


def _as_text(b, k: int) -> dict:
    """Sample ``k`` of the batch as the guard hands it on after a drop: no pixel rows, its soft
    tokens their own token's embedding (no feature), its ``token_type_ids`` 0 (no blocks)."""
    ids = b.input_ids[k : k + 1]
    attn = b.kwargs["attention_mask"][k : k + 1]
    return dict(input_ids=ids, attention_mask=attn, token_type_ids=torch.zeros_like(ids))


@pytest.mark.parametrize("name,samples,bad,kept", FAULTS, ids=[f[0] for f in FAULTS])
def test_drop_keeps_every_other_sample_equal_to_its_own_forward(model, name, samples, bad, kept):
    pas = "crop" in name
    cfg = GuardConfig(policy="drop")
    emb, (b, hidden, out, res) = decoder_inputs(
        model.model.language_model,
        lambda: guarded(model, samples, cfg, labels=True, pan_and_scan=pas),
    )
    assert {s for s, a in enumerate(res.report.actions) if a == "drop"} == bad
    n = b.lengths[kept]
    torch.testing.assert_close(hidden[kept, :n], own(model, samples[kept], pan_and_scan=pas))
    embed = model.get_input_embeddings()
    for k in bad:
        text = _as_text(b, k)
        assert torch.equal(emb[k], embed(text["input_ids"])[0])  # no feature in its row
        # its bidirectional blocks went with its soft tokens: the plain model on that text
        with torch.no_grad():
            want = model.model(**text).last_hidden_state[0]
        torch.testing.assert_close(hidden[k], want, atol=1e-5, rtol=1e-5)
        assert (res.labels[k] == -100).all()
    assert torch.isfinite(out.loss)


def test_an_equal_size_swap_is_invisible_to_every_count(model):
    """Every row has mm features: a swap changes no count, for the plain model and the guard
    alike (the guard keeps the batch; nothing in the inputs tells the rows apart)."""
    b, hidden, _, res = guarded(model, [[TALL, SQUARE], [WIDE]], swap=(0, 2))
    assert res.report.actions == ("keep", "keep")
    torch.testing.assert_close(hidden, F.plain_hidden(model, b), atol=1e-6, rtol=1e-6)


def test_repair_falls_back_no_resize_reaches_another_count(model, tmp_path):
    g = guard_for(spec_mod.SPEC, model, GuardConfig(policy="repair"))
    assert g.geometry == FixedGeometry(F.MM_TOKENS, (F.IMAGE_SIZE, F.IMAGE_SIZE))
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    samples = [[M("image", (32, 32), tokens=3)], [WIDE]]
    b, hidden, _, res = guarded(model, samples, cfg)
    assert res.report.actions == ("drop", "keep")
    recs = records(tmp_path)
    why = " ".join(str(r.get("reason")) for r in recs if r["sample"] == 0)
    assert "cannot be reached by resizing" in why, recs
    torch.testing.assert_close(hidden[1, : b.lengths[1]], own(model, [WIDE]))
