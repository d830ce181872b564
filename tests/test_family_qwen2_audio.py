"""install_vlm on transformers' real ``Qwen2AudioForConditionalGeneration`` / ``Qwen2AudioModel``
(tiny random config, CPU): audio clips, ``<|audio_bos|>`` ``<|AUDIO|>``xN ``<|audio_eos|>``.

The fixture (``testing/families/qwen2_audio.py``) against the real ``Qwen2AudioProcessor``
(``WhisperFeatureExtractor`` and an in-memory word-level tokenizer with the real special ids)
and the tower's ``_get_feat_extract_output_lengths`` first; then the plain class's legacy path
(a run cut to ONE placeholder is re-expanded: the output grows longer than the ids) and an
orphan clip. Calls go through ``model.model`` (the 151680-wide ``lm_head`` would cost most of
the time). The plain class under the other faults: ``tests/test_fixture_plain.py``; the shared
contract and the family's own faults: ``tests/families/``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_checks import aud, guarded_forward

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.testing.families import qwen2_audio as F

pytestmark = pytest.mark.timeout(120)
AUDIO = 151646  # <|AUDIO|>


@pytest.fixture(scope="module")
def model():
    return F.tiny_model(seed=0)


def _processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor, WhisperFeatureExtractor

    specials = {F.AUDIO_TOKEN: AUDIO, F.BOS_TOKEN: F.BOS_ID, F.EOS_TOKEN: F.EOS_ID}
    vocab = {
        "[UNK]": 0,
        **{f"w{i}": i for i in range(1, 20)},
        "<|endoftext|>": F.PAD_ID,
        **specials,
    }
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="<|endoftext|>",
        additional_special_tokens=list(specials),
    )  # fmt: skip
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=F.SAMPLING_RATE)
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok)


SAMPLES = [1, 320, 321, 1600, 123457, 500000]


def test_counts_and_layout_match_qwen2_audio_processor(model):
    proc = _processor()
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) for n in SAMPLES]
    text = [f"w1 {F.BOS_TOKEN}{F.AUDIO_TOKEN}{F.EOS_TOKEN} w2" for _ in SAMPLES]
    out = proc(text=text, audio=clips, return_tensors="pt", padding=True)
    frames = [F.mel_frames(n) for n in SAMPLES]
    assert out["feature_attention_mask"].sum(-1).tolist() == frames
    assert out["feature_attention_mask"].dtype == torch.int32
    assert out["input_features"].shape == (len(SAMPLES), 128, F.max_frames(model))
    assert out["input_features"].dtype == torch.float32
    # the processor's rows == the fixture's run (1 text id each side instead of text_len)
    b = F.make_batch(model, [[aud(f)] for f in frames], text_len=1)
    for s, f in enumerate(frames):
        want = [F.BOS_ID, *[AUDIO] * F.num_features(f), F.EOS_ID]
        got = out["input_ids"][s][out["attention_mask"][s] == 1].tolist()
        assert got[1:-1] == want == b.input_ids[s, 1 : b.lengths[s] - 1].tolist()
    assert [n for _, _, n in b.items] == [F.num_features(f) for f in frames]


def test_count_formula_is_the_towers(model):
    frames = torch.arange(1, 3001)
    _, n = model.model.audio_tower._get_feat_extract_output_lengths(frames)
    assert n.tolist() == [F.num_features(f) for f in range(1, 3001)]
    assert n.tolist() == ((frames + 1) // 4).tolist()  # the closed form in the notes
    assert F.num_features(1) == F.num_features(2) == 0 and F.num_features(3000) == 750


@pytest.mark.parametrize(
    "samples, grown",
    [
        ([[aud(100, n=1)]], 24),  # one sample, its run cut to 1 placeholder
        ([[aud(100, n=1)], [aud(40, n=1)]], 24),  # both cut: rows padded to the longest
    ],
)
def test_unguarded_single_placeholder_runs_take_the_legacy_expansion(model, samples, grown):
    b = F.make_batch(model, samples)
    with torch.no_grad():
        hidden = model.model(**b.kwargs).last_hidden_state  # no error: the legacy merge expands
    assert hidden.shape[1] == b.input_ids.shape[1] + grown


def test_a_clip_whose_run_has_no_placeholder_is_an_orphan_set_items_attributes(model, tmp_path):
    """bos/eos with nothing between is no run: raise names the item; drop leaves the clip
    unused (the report says so); ``set_items`` ties it to its sample, which is dropped."""
    mm, samples = model.model, [[aud(40)], [aud(100, n=0)], [aud(61)]]
    with pytest.raises(
        MediaAlignmentError, match=r"items \[1\] could not be tied to a placeholder run"
    ):
        guarded_forward(F, mm, samples, GuardConfig(log_dir=str(tmp_path)))
    res = guarded_forward(F, mm, samples, GuardConfig(policy="drop"))[2]
    assert res.report.actions == ("keep",) * 3 and res.report.alignment.orphans == (1,)
    assert not res.report.ok
    items = [MediaItem(0, sample=s, modality="audio") for s in range(3)]
    b, out, res = guarded_forward(F, mm, samples, GuardConfig(policy="drop"), items)
    assert res.report.actions == ("keep", "drop", "keep")
    for k in (0, 2):
        alone = F.make_batch(mm, [samples[k]])
        with torch.no_grad():
            want = mm(**alone.kwargs).last_hidden_state[0]
        torch.testing.assert_close(
            out.last_hidden_state[k, : b.lengths[k]], want, atol=1e-5, rtol=0
        )
