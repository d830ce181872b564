"""install_vlm on transformers' real ``Qwen2AudioForConditionalGeneration`` / ``Qwen2AudioModel``
(tiny random config, CPU): audio clips, ``<|audio_bos|>`` ``<|AUDIO|>``xN ``<|audio_eos|>``.

Inputs come from ``testing/families/qwen2_audio.py`` (checked against the real processor in
``tests/test_fixture_qwen2_audio.py``). Most calls go through ``model.model`` (the
``Qwen2AudioModel``: the 151680-wide ``lm_head`` would cost most of the time) and compare last
hidden states; the labels / loss tests use the full class. The tower always runs 3000 mel
frames, so each sample of a plain batch equals its own forward.
"""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.families import find_family
from megatron_media_guard.testing.families import qwen2_audio as F
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)
AUDIO = 151646


def aud(frames: int, tokens: int | None = None) -> Media:
    return Media("audio", (frames,), tokens)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def hidden(model, kwargs):
    with torch.no_grad():
        return model.model(**kwargs).last_hidden_state


def own(model, sample):
    b = F.make_batch(model, [sample])
    return hidden(model, b.kwargs)[0, : b.lengths[0]]


def guarded(model, samples, config=None, items=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model.model, config or GuardConfig()) as h:
        if items is not None:
            h.set_items(items)
        out = hidden(model, b.kwargs)
        return b, out, h.last_result


def test_aligned_call_on_the_full_class_is_bit_identical_with_one_transfer(model):
    b = F.make_batch(model, [[aud(100)], [aud(40), aud(77)]])
    with torch.no_grad():
        ref = model(**b.kwargs).logits
    h = install_vlm(model, GuardConfig())
    assert h.module is model  # the outermost class the family knows
    with h, count_transfers() as n, torch.no_grad():
        out = model(**b.kwargs).logits
    assert torch.equal(out, ref)
    # the clips' feature counts (to cut the projector's padded rows) ride in the verdict
    assert dict(n) == {"aligned-path verdict": 1}, n


def test_a_clip_whose_run_has_no_placeholder_is_an_orphan_set_items_attributes(model, tmp_path):
    """bos/eos with nothing between is no run: raise names the item; drop leaves the clip
    unused (the report says so); ``set_items`` ties it to its sample, which is dropped."""
    samples = [[aud(40)], [aud(100, tokens=0)], [aud(61)]]
    with pytest.raises(
        MediaAlignmentError, match=r"items \[1\] could not be tied to a placeholder run"
    ):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)))
    b, out, res = guarded(model, samples, GuardConfig(policy="drop"))
    assert res.report.actions == ("keep",) * 3 and res.report.alignment.orphans == (1,)
    assert not res.report.ok
    items = [MediaItem(0, sample=s, modality="audio") for s in range(3)]
    b, out, res = guarded(model, samples, GuardConfig(policy="drop"), items=items)
    assert res.report.actions == ("keep", "drop", "keep")
    for k in (0, 2):
        torch.testing.assert_close(
            out[k, : b.lengths[k]], own(model, samples[k]), atol=1e-5, rtol=0
        )


def test_drop_feeds_no_feature_to_the_dropped_rows(model):
    samples = [[aud(100)], [aud(40)], [aud(61)]]
    b = F.make_batch(model, samples, swap=(0, 1))
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].detach().clone()), with_kwargs=True
    )
    try:
        _, _, res = guarded(model, samples, GuardConfig(policy="drop"), swap=(0, 1))
    finally:
        hook.remove()
    assert res.report.actions == ("drop", "drop", "keep")
    text = model.get_input_embeddings()(b.input_ids)
    assert torch.equal(seen[0][:2], text[:2])  # every placeholder kept its token's embedding


def test_repair_falls_back_naming_the_family(model, tmp_path):
    cfg = GuardConfig(policy="repair", fallback="raise", log_dir=str(tmp_path))
    with pytest.raises(MediaAlignmentError, match="no geometry for qwen2_audio"):
        guarded(model, [[aud(100, tokens=24)], [aud(40)]], cfg)
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path))  # fallback drop
    _, _, res = guarded(model, [[aud(100, tokens=24)], [aud(40)]], cfg)
    assert res.report.actions == ("drop", "keep")


def test_set_items_names_the_sample_id(model, tmp_path):
    samples = [[aud(100)], [aud(40, tokens=9)]]
    items = [MediaItem(0, sample=s, modality="audio", sample_id=n) for s, n in ((0, "a"), (1, "b"))]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), items=items)


def test_remove_restores_the_plain_model_and_its_legacy_path(model):
    b = F.make_batch(model, [[aud(100, tokens=1)]])
    h = install_vlm(model.model, GuardConfig())
    h.remove()
    out = hidden(model, b.kwargs)  # plain again: the single placeholder is expanded
    assert out.shape[1] == b.input_ids.shape[1] + 24


def test_the_registry_knows_both_transformers_classes(model):
    assert find_family(model)[1].name == "qwen2_audio"
    assert find_family(model.model) == (model.model, find_family(model)[1])
