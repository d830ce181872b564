"""install_vlm on transformers' real ``Qwen3OmniMoeThinkerForConditionalGeneration`` (tiny random
config with deepstack, CPU): images, one-run videos, audio clips, videos with their audio track
(``use_audio_in_video``: one region of interleaved runs, laid out by the processor's own method);
MRoPE positions from the grids.

Inputs come from ``testing/families/qwen3_omni.py`` (``tests/test_fixture_plain.py`` pins
the plain model: aligned batches equal each sample's own forward, +k/-k and swaps are silent,
audio is not counted at all). The guarded forward must equal the plain one on aligned batches,
deepstack included, and each kept sample its own plain forward after a drop.
"""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.adapters import install_vlm
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


def guarded(model, samples, config=None, **kw):
    b = F.make_batch(model, samples, **kw)
    with install_vlm(model, config or GuardConfig(), tokenizer=TOKENS) as h:
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


def aiv(t, h, w, length, tokens=None):
    """A video of grid (t, h, w) with its audio track of ``length`` mel frames."""
    return Media("video", (t, h, w, length), tokens)


def bent(model, media, run, k):
    """``media`` (audio in video) with its ``run``-th run (token order) ``k`` longer."""
    lengths = [n for _, n in F.interleaved_runs(model, media.size[:3], media.size[3])]
    lengths[run] += k
    return aiv(*media.size, tokens=tuple(lengths))


# (3, 4, 4) + 400 frames: video 4, audio 50, video 4, audio 2, video 4 (position_id_per_seconds
# 25, 2 s per grid); (2, 4, 4) + 230 frames: video 4, audio 30, video 4
LONG, SHORT = aiv(3, 4, 4, 400), aiv(2, 4, 4, 230)
AIV_ALIGNED = [
    ("two videos with their audio", [[LONG], [SHORT]]),
    ("beside a plain image and a plain clip", [[LONG], [img(2, 2), aud(100)]]),
    ("a plain clip and an image around it in one sample", [[aud(60), SHORT, img(2, 4)], [LONG]]),
]


@pytest.mark.parametrize("name,samples", AIV_ALIGNED, ids=[n for n, _ in AIV_ALIGNED])
def test_audio_in_video_aligned_equals_the_plain_model(model, name, samples):
    b, out, res = guarded(model, samples)
    assert b.kwargs["use_audio_in_video"] is True
    assert res.report.actions == ("keep",) * len(samples)
    torch.testing.assert_close(out, logits(model, b.kwargs), atol=1e-6, rtol=1e-6)
    for k, sample in enumerate(samples):  # and each sample its own forward
        got = out[k, : b.lengths[k]]
        torch.testing.assert_close(got, own(model, sample), atol=1e-5, rtol=1e-5)


def test_audio_in_video_is_checked_per_chunk(model):
    """The video and its clip are cut into the runs the interleaving predicts: one item each."""
    b, _, res = guarded(model, [[LONG], [SHORT]])
    assert b.runs == [
        [("video", 4), ("audio", 50), ("video", 4), ("audio", 2), ("video", 4)],
        [("video", 4), ("audio", 30), ("video", 4)],
    ]
    assert res.report.actions == ("keep", "keep")


# (samples, every bad sample, swap, the item the first message names: token order in its
# sample); the plain model: a short audio chunk and +k/-k run silently, a short video block
# raises on the totals, the swap crashes in rope
AIV_FAULTS = [
    ("short audio chunk", lambda m: [[bent(m, LONG, 1, -1)], [SHORT]], {0}, None, "audio item 1"),
    ("short video block", lambda m: [[bent(m, LONG, 2, -1)], [SHORT]], {0}, None, "video item 2"),
    (
        "+k/-k audio chunks",
        lambda m: [[bent(m, LONG, 1, 2)], [bent(m, SHORT, 1, -2)]],
        {0, 1},
        None,
        "audio item 1",
    ),
    (
        "+k/-k against a plain clip",
        lambda m: [[bent(m, LONG, 3, 2)], [aud(100, 11)]],
        {0, 1},
        None,
        "audio item 3",
    ),
    (
        "+k/-k video blocks",
        lambda m: [[bent(m, LONG, 0, 1)], [bent(m, SHORT, 2, -1)]],
        {0, 1},
        None,
        "video item 0",
    ),
    ("swap of the tracks", lambda m: [[LONG], [SHORT]], {0, 1}, (0, 1), "audio item 1"),
]


@pytest.mark.parametrize("name,make,bads,swap,item", AIV_FAULTS, ids=[f[0] for f in AIV_FAULTS])
def test_audio_in_video_raise_names_the_sample_and_item(model, name, make, bads, swap, item):
    with pytest.raises(MediaAlignmentError) as err:
        guarded(model, make(model), swap=swap)
    first = str(err.value).splitlines()[1]
    assert first.strip().startswith(f"sample {min(bads)} ") and item in first, first


@pytest.mark.parametrize("name,make,bads,swap,item", AIV_FAULTS, ids=[f[0] for f in AIV_FAULTS])
def test_audio_in_video_drop_keeps_the_others_equal_to_their_own_forward(
    model, name, make, bads, swap, item
):
    samples = [*make(model), [img(2, 4), aiv(2, 2, 4, 150)]]  # an aligned bystander, last
    b = F.make_batch(model, samples, swap=swap)
    with install_vlm(model, GuardConfig(policy="drop"), tokenizer=TOKENS) as h:
        seen = lm_inputs(model, lambda: logits(model, b.kwargs))
        out = model(**b.kwargs, labels=b.input_ids.clone())
        res = h.last_result
    dropped = {s for s, a in enumerate(res.report.actions) if a == "drop"}
    assert dropped == bads
    for k in set(range(len(samples))) - dropped:
        got = out.logits[k, : b.lengths[k]].detach()
        torch.testing.assert_close(got, own(model, samples[k]), atol=1e-5, rtol=1e-5)
    text = model.get_input_embeddings()(b.input_ids)
    for s in dropped:  # no feature, no deepstack in a dropped row; its labels ignored
        assert torch.equal(seen["inputs_embeds"][s], text[s])
        assert not seen["visual_pos_masks"][s].any()
        assert (res.labels[s] == -100).all()
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize(
    "samples, flag, match",
    [
        ([[LONG], [vid(2, 4, 4)]], True, r"sample 1 has a video region without its audio"),
        ([[LONG]], False, r"sample 0 has a video region with its audio"),
        ([[vid(2, 4, 4)]], True, "use_audio_in_video=True and no audio clips"),
    ],
    ids=["a silent video under the flag", "audio in video without the flag", "no clips"],
)
def test_flag_and_ids_that_disagree_are_refused(model, samples, flag, match):
    """The model's get_rope_index miscounts both silently (measured: the other samples'
    logits change too)."""
    b = F.make_batch(model, samples)
    b.kwargs["use_audio_in_video"] = flag
    with (
        install_vlm(model, GuardConfig(), tokenizer=TOKENS),
        pytest.raises(MediaInputError, match=match),
    ):
        logits(model, b.kwargs)


def test_a_thinker_config_without_vision_start_is_refused_at_install():
    bare = F.tiny_model(seed=1, vision_start_token_id=None)
    with pytest.raises(MediaInputError, match=r"config\.vision_start_token_id"):
        install_vlm(bare, GuardConfig(), tokenizer={**TOKENS, "<|vision_start|>": F.VISION_START})
