"""install_vlm on transformers' real ``Qwen3OmniMoeThinkerForConditionalGeneration`` (tiny random
config with deepstack, CPU): images, one-run videos, audio clips, videos with their audio track
(``use_audio_in_video``: one region of interleaved runs, laid out by the processor's own method);
MRoPE positions from the grids.

Inputs come from ``testing/families/qwen3_omni.py`` (``tests/test_fixture_plain.py`` pins
the plain model: +k/-k and swaps are silent, audio is not counted at all). Aligned batches
equal the plain forward and each sample its own, a raise names the sample (and the item of
an audio-in-video fault, ``AIV_FAULTS``) and a drop feeds no feature and no deepstack row to
the dropped sample: ``tests/families/``; here deepstack as in the plain forward.
"""

from __future__ import annotations

import pytest
import torch
from family_checks import aud, img, logits, spy, vid

from megatron_media_guard import GuardConfig
from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing.families import qwen3_omni as F

pytestmark = pytest.mark.timeout(120)
TOKENS = {"<|vision_end|>": F.VISION_END, "<|audio_end|>": F.AUDIO_END}


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def test_deepstack_reaches_the_text_model_as_in_the_plain_forward(model):
    b = F.make_batch(model, [[img(4, 4), aud(80)], [vid(2, 4, 4)]])
    lm = model.model.language_model
    with spy(lm) as (plain, _):
        logits(model, b.kwargs)
    with install_vlm(model, GuardConfig(), tokenizer=TOKENS), spy(lm) as (mine, _):
        logits(model, b.kwargs)
    assert mine["deepstack_visual_embeds"] is not None
    assert torch.equal(mine["visual_pos_masks"], plain["visual_pos_masks"])
    for a, p in zip(mine["deepstack_visual_embeds"], plain["deepstack_visual_embeds"], strict=True):
        assert torch.equal(a, p)
    assert torch.equal(mine["position_ids"], plain["position_ids"])


# videos with their audio track, (t, h, w) + mel frames, and their runs in token order
# (position_id_per_seconds 25, 2 s per grid): video 4, audio 50, video 4, audio 2, video 4;
# video 4, audio 30, video 4. A fault gives the runs' lengths (n=).
LONG, SHORT = vid(3, 4, 4, 400), vid(2, 4, 4, 230)


def long(*runs):
    return vid(3, 4, 4, 400, n=runs)


def short(*runs):
    return vid(2, 4, 4, 230, n=runs)


def test_a_video_with_its_audio_is_laid_out_in_the_processors_runs(model):
    """The runs the guard checks one by one (an item each): the processor's interleaving."""
    b = F.make_batch(model, [[LONG], [SHORT]])
    assert b.kwargs["use_audio_in_video"] is True
    assert b.runs == [
        [("video", 4), ("audio", 50), ("video", 4), ("audio", 2), ("video", 4)],
        [("video", 4), ("audio", 30), ("video", 4)],
    ]


# (samples, every bad sample, swap, the item the raise names on the first bad sample's line:
# token order in its sample), rows of the contract's fault tests (tests/families/); the plain
# model: a short audio chunk and +k/-k run silently, a short video block raises on the
# totals, the swap crashes in rope
AIV_FAULTS = [
    ("short audio chunk", [[long(4, 49, 4, 2, 4)], [SHORT]], {0}, None, "audio item 1"),
    ("short video block", [[long(4, 50, 3, 2, 4)], [SHORT]], {0}, None, "video item 2"),
    ("+k/-k audio chunks", [[long(4, 52, 4, 2, 4)], [short(4, 28, 4)]], {0, 1}, None,
     "audio item 1"),
    ("+k/-k against a plain clip", [[long(4, 50, 4, 4, 4)], [aud(100, n=11)]], {0, 1}, None,
     "audio item 3"),
    ("+k/-k video blocks", [[long(5, 50, 4, 2, 4)], [short(4, 30, 3)]], {0, 1}, None,
     "video item 0"),
    ("swap of the tracks", [[LONG], [SHORT]], {0, 1}, (0, 1), "audio item 1"),
]  # fmt: skip


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
    """The thinker config lacks it: the plain forward then crashes in its rope."""
    bare = F.tiny_model(seed=1, vision_start_token_id=None)
    with pytest.raises(AttributeError, match="has no attribute 'vision_start_token_id'"):
        logits(bare, F.make_batch(bare, [[img(2, 2)]]).kwargs)
    with pytest.raises(MediaInputError, match=r"config\.vision_start_token_id"):
        install_vlm(bare, GuardConfig(), tokenizer={**TOKENS, "<|vision_start|>": F.VISION_START})
