"""install_vlm on transformers' real ``Qwen3OmniMoeThinkerForConditionalGeneration`` (tiny random
config with deepstack, CPU): images, one-run videos, audio clips; MRoPE positions from the grids.

Inputs come from ``testing/families/qwen3_omni.py`` (``tests/test_fixture_qwen3_omni.py`` pins
the plain model: aligned batches equal each sample's own forward, +k/-k and swaps are silent,
audio is not counted at all). The guarded forward must equal the plain one on aligned batches,
deepstack included, and each kept sample its own plain forward after a drop.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing.families import qwen3_omni as F
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)
TOKENS = {"<|vision_end|>": F.VISION_END, "<|audio_end|>": F.AUDIO_END}


def img(h, w, tokens=None):
    return Media("image", (h, w), tokens)


def vid(t, h, w, tokens=None):
    return Media("video", (t, h, w), tokens)


def aud(length, tokens=None):
    return Media("audio", (length,), tokens)


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def logits(model, kwargs, **kw):
    with torch.no_grad():
        return model(**kwargs, **kw).logits


def own(model, sample):
    b = F.make_batch(model, [[Media(m.modality, m.size) for m in sample]])
    return logits(model, b.kwargs)[0]


def guarded(model, samples, config=None, items=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, config or GuardConfig(), tokenizer=TOKENS) as h:
        if items is not None:
            h.set_items(items)
        return b, logits(model, b.kwargs), h.last_result


def lm_inputs(model, fn):
    """What the text model received during ``fn()``: its keyword arguments."""
    seen = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(kw), with_kwargs=True
    )
    try:
        fn()
    finally:
        hook.remove()
    return seen


ALIGNED = [
    ("images", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
    ("videos", [[vid(2, 4, 4)], [vid(3, 2, 4)]]),
    ("audio", [[aud(100)], [aud(60), aud(230)]]),
    ("mixed", [[img(4, 4), aud(80)], [vid(2, 4, 4)], [aud(50), img(2, 2)]]),
    ("image and video in one sample", [[vid(2, 2, 4), img(2, 4)], [img(4, 4)]]),
]


@pytest.mark.parametrize("name,samples", ALIGNED, ids=[n for n, _ in ALIGNED])
def test_aligned_batches_equal_the_plain_model(model, name, samples):
    b, out, res = guarded(model, samples)
    assert res.report.actions == ("keep",) * len(samples)
    torch.testing.assert_close(out, logits(model, b.kwargs), atol=1e-6, rtol=1e-6)


def test_deepstack_reaches_the_text_model_as_in_the_plain_forward(model):
    b = F.make_batch(model, [[img(4, 4), aud(80)], [vid(2, 4, 4)]])
    plain = lm_inputs(model, lambda: logits(model, b.kwargs))
    with install_vlm(model, GuardConfig(), tokenizer=TOKENS):
        mine = lm_inputs(model, lambda: logits(model, b.kwargs))
    assert mine["deepstack_visual_embeds"] is not None
    assert torch.equal(mine["visual_pos_masks"], plain["visual_pos_masks"])
    for a, p in zip(mine["deepstack_visual_embeds"], plain["deepstack_visual_embeds"], strict=True):
        assert torch.equal(a, p)
    assert torch.equal(mine["position_ids"], plain["position_ids"])


@pytest.mark.parametrize(
    "samples,transfers",
    [([[img(4, 6)], [img(8, 4)]], 1), ([[aud(100)], [aud(60)]], 2)],
    ids=["images: the verdict", "audio: the clip lengths and the verdict"],
)
def test_single_modality_aligned_call_is_bit_identical(model, samples, transfers):
    b = F.make_batch(model, samples)
    ref = logits(model, b.kwargs)
    with install_vlm(model, GuardConfig(), tokenizer=TOKENS), count_transfers() as n:
        out = logits(model, b.kwargs)
    assert torch.equal(out, ref)
    assert sum(n.values()) == transfers, n


# (samples, the bad sample, swap); a third aligned sample stands by in the drop test
FAULTS = [
    ("short image run", [[img(4, 6, tokens=5)], [img(8, 4)]], 0, None),
    ("+k/-k images", [[img(4, 6, tokens=8)], [img(8, 4, tokens=6)]], 0, None),
    ("swap of images", [[img(4, 6)], [img(8, 4)]], 0, (0, 1)),
    ("+k/-k videos", [[vid(2, 4, 4, tokens=10)], [vid(3, 2, 4, tokens=4)]], 0, None),
    ("short audio run", [[aud(100, tokens=10)], [aud(60)]], 0, None),
    ("surplus audio run", [[aud(60)], [aud(100, tokens=16)]], 1, None),
    ("+k/-k audio", [[aud(100, tokens=16)], [aud(60, tokens=5)]], 0, None),
    ("swap of audio clips", [[aud(100)], [aud(60)]], 0, (0, 1)),
    ("audio fault beside an image", [[aud(100, tokens=10), img(2, 2)], [aud(60)]], 0, None),
]


@pytest.mark.parametrize("name,samples,bad,swap", FAULTS, ids=[f[0] for f in FAULTS])
def test_raise_names_the_sample(model, name, samples, bad, swap, tmp_path):
    cfg = GuardConfig(log_dir=str(tmp_path))
    with pytest.raises(MediaAlignmentError, match=rf"sample {bad}\b"):
        guarded(model, samples, cfg, swap=swap)
    recs = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert any(r["event"] == "raise" and r["sample"] == bad for r in recs)


@pytest.mark.parametrize("name,samples,bad,swap", FAULTS, ids=[f[0] for f in FAULTS])
def test_drop_keeps_every_other_sample_equal_to_its_own_forward(model, name, samples, bad, swap):
    # an aligned bystander (after the faulty samples in every modality's consumption order;
    # no audio clip beside an image swap: audio is consumed first and would shift its indices)
    extra = [] if swap is not None and "image" in name else [aud(50)]
    samples = [*samples, [img(2, 4), vid(2, 2, 2), *extra]]
    b = F.make_batch(model, samples, swap=swap)
    labels = b.input_ids.clone()
    with install_vlm(model, GuardConfig(policy="drop"), tokenizer=TOKENS) as h:
        out = model(**b.kwargs, labels=labels)
        res = h.last_result
    dropped = {s for s, a in enumerate(res.report.actions) if a == "drop"}
    assert bad in dropped and len(samples) - 1 not in dropped
    for k in set(range(len(samples))) - dropped:
        want = own(model, samples[k])
        got = out.logits[k, : b.lengths[k]].detach()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for s in dropped:
        assert (res.labels[s] == -100).all()
    assert torch.isfinite(out.loss)


def test_drop_feeds_no_feature_and_no_deepstack_to_the_dropped_rows(model):
    samples = [[img(4, 6), aud(100)], [img(8, 4), aud(60)], [img(2, 2)]]
    b = F.make_batch(model, samples, swap=(0, 1))  # the two audio clips exchanged
    with install_vlm(model, GuardConfig(policy="drop"), tokenizer=TOKENS) as h:
        seen = lm_inputs(model, lambda: logits(model, b.kwargs))
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    text = model.get_input_embeddings()(b.input_ids)
    assert torch.equal(seen["inputs_embeds"][:2], text[:2])
    assert not seen["visual_pos_masks"][:2].any()  # deepstack only at the kept image's rows
    assert seen["visual_pos_masks"][2].sum() == 1


def test_repair_falls_back_naming_the_family(model):
    cfg = GuardConfig(policy="repair", fallback="raise")
    with pytest.raises(MediaAlignmentError, match="no geometry for qwen3_omni"):
        guarded(model, [[img(4, 6, tokens=5)], [img(8, 4)]], cfg)


def test_set_items_names_the_sample_id(model, tmp_path):
    samples = [[aud(100), img(2, 2)], [aud(60, tokens=5)]]
    items = [
        MediaItem(0, sample=0, modality="audio", sample_id="a"),
        MediaItem(0, sample=0, modality="image", sample_id="a"),
        MediaItem(0, sample=1, modality="audio", sample_id="b"),
    ]
    with pytest.raises(MediaAlignmentError, match="sample_id 'b'"):
        guarded(model, samples, GuardConfig(log_dir=str(tmp_path)), items=items)


def test_use_audio_in_video_is_refused_clearly(model):
    b = F.make_batch(model, [[vid(2, 4, 4)]])
    with (
        install_vlm(model, GuardConfig(), tokenizer=TOKENS),
        pytest.raises(MediaInputError, match="use_audio_in_video"),
    ):
        logits(model, b.kwargs, use_audio_in_video=True)


def test_remove_restores_the_plain_model(model):
    b = F.make_batch(model, [[aud(100, tokens=16)], [aud(60, tokens=5)]])
    h = install_vlm(model, GuardConfig(), tokenizer=TOKENS)
    h.remove()
    logits(model, b.kwargs)  # plain again: +k/-k audio runs silently


def test_missing_markers_name_the_tokens(model):
    with pytest.raises(MediaInputError, match="audio start/end markers"):
        install_vlm(model, GuardConfig())


def test_a_thinker_config_without_vision_start_is_refused_at_install():
    bare = F.tiny_model(seed=1, vision_start_token_id=None)
    with pytest.raises(MediaInputError, match=r"config\.vision_start_token_id"):
        install_vlm(bare, GuardConfig(), tokenizer={**TOKENS, "<|vision_start|>": F.VISION_START})


@pytest.mark.parametrize("mode, runs", [("always", 1), ("on_drop", 0), ("never", 0)])
def test_a_text_only_micro_batch_keeps_the_tower_in_step(model, mode, runs):
    """keep_tower (docs/PARALLEL.md): both towers on zeros (a 2x2-patch image, its deepstack
    mergers included, and one audio chunk); every parameter an image + audio batch trains
    gets a zero gradient."""
    from tower_check import check_keeps_tower

    media, text = (F.make_batch(model, s).kwargs for s in ([[img(2, 2), aud(120)]], [[], []]))
    inner = model.model
    check_keeps_tower(
        model,
        mode,
        runs,
        media=media,
        text=text,
        tokenizer=TOKENS,
        towers=[inner.visual, inner.audio_tower],
        decoder=inner.language_model,
    )
