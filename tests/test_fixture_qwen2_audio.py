"""The Qwen2-Audio fixture on the real transformers class (tiny random config, CPU).

1. the fixture's arithmetic against the real ``Qwen2AudioProcessor`` (``WhisperFeatureExtractor``
   and an in-memory word-level tokenizer with the real special ids) and the tower's own
   ``_get_feat_extract_output_lengths``;
2. aligned batches: each sample's last hidden states (the logits' only input: ``lm_head`` is
   linear) equal its own batch's;
3. the unguarded behaviour, pinned: a short run / surplus raises, +k/-k and a swap run silently with
   features in the wrong sample, and a run cut to ONE placeholder in a batch with no two adjacent
   placeholders takes the legacy path, which re-expands it (the output grows longer than the ids).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_media_guard.testing.families import qwen2_audio as fam
from megatron_media_guard.testing.families.base import Media

pytestmark = pytest.mark.timeout(120)


def aud(frames: int, tokens: int | None = None) -> Media:
    return Media("audio", (frames,), tokens)


@pytest.fixture(scope="module")
def model():
    return fam.tiny_model(seed=0)


def _run(model, kwargs):
    """(last hidden states, ``inputs_embeds`` the LM received, projector output ``[n, 750, hidden]``).
    Hidden states, not logits: the 151680-wide ``lm_head`` is a linear map of them and costs most
    of the forward."""
    seen = {}

    def grab_lm(_mod, _args, kw):
        seen["emb"] = kw["inputs_embeds"].detach().clone()

    def grab_proj(_mod, _args, out):
        seen["proj"] = out.detach().clone()

    hooks = [
        model.model.language_model.register_forward_pre_hook(grab_lm, with_kwargs=True),
        model.model.multi_modal_projector.register_forward_hook(grab_proj),
    ]
    try:
        with torch.no_grad():
            hidden = model.model(**kwargs).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    return hidden, seen["emb"], seen.get("proj")


def _own(model, sample):
    with torch.no_grad():
        return model.model(**fam.make_batch(model, [sample]).kwargs).last_hidden_state[0]


# -- 1. oracles ---------------------------------------------------------------------------------


def _processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor, WhisperFeatureExtractor

    specials = {fam.AUDIO_TOKEN: 151646, fam.BOS_TOKEN: fam.BOS_ID, fam.EOS_TOKEN: fam.EOS_ID}
    vocab = {
        "[UNK]": 0,
        **{f"w{i}": i for i in range(1, 20)},
        "<|endoftext|>": fam.PAD_ID,
        **specials,
    }
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="<|endoftext|>",
        additional_special_tokens=list(specials),
    )  # fmt: skip
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=fam.SAMPLING_RATE)
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok)


SAMPLES = [1, 320, 321, 1600, 123457, 500000]


def test_counts_and_layout_match_qwen2_audio_processor(model):
    proc = _processor()
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) for n in SAMPLES]
    text = [f"w1 {fam.BOS_TOKEN}{fam.AUDIO_TOKEN}{fam.EOS_TOKEN} w2" for _ in SAMPLES]
    out = proc(text=text, audio=clips, return_tensors="pt", padding=True)
    frames = [fam.mel_frames(n) for n in SAMPLES]
    assert out["feature_attention_mask"].sum(-1).tolist() == frames
    assert out["feature_attention_mask"].dtype == torch.int32
    assert out["input_features"].shape == (len(SAMPLES), 128, fam.max_frames(model))
    assert out["input_features"].dtype == torch.float32
    # the processor's rows == the fixture's run (1 text id each side instead of text_len)
    b = fam.make_batch(model, [[aud(f)] for f in frames], text_len=1)
    for s, f in enumerate(frames):
        want = [fam.BOS_ID, *[151646] * fam.num_features(f), fam.EOS_ID]
        got = out["input_ids"][s][out["attention_mask"][s] == 1].tolist()
        assert got[1:-1] == want == b.input_ids[s, 1 : b.lengths[s] - 1].tolist()
    assert [n for _, _, n in b.items] == [fam.num_features(f) for f in frames]


def test_count_formula_is_the_towers():
    frames = torch.arange(1, 3001)
    _, n = fam.tiny_model().model.audio_tower._get_feat_extract_output_lengths(frames)
    assert n.tolist() == [fam.num_features(f) for f in range(1, 3001)]
    assert n.tolist() == ((frames + 1) // 4).tolist()  # the closed form in the notes
    assert fam.num_features(1) == fam.num_features(2) == 0 and fam.num_features(3000) == 750


def test_feature_rows_match_projector(model):
    b = fam.make_batch(model, [[aud(100), aud(41)], [aud(3000)]])
    _, emb, proj = _run(model, b.kwargs)
    for s in range(2):
        pos = (b.input_ids[s] == model.config.audio_token_id).nonzero().flatten()
        items = [n for (t, _, n) in b.items if t == s]
        rows = [proj[q][:n] for q, (t, _, n) in enumerate(b.items) if t == s]
        assert len(pos) == sum(items)
        torch.testing.assert_close(emb[s, pos], torch.cat(rows))


# -- 2. aligned ---------------------------------------------------------------------------------

ALIGNED = {
    "one_each": [[aud(100)], [aud(40)]],
    "ragged_with_text_only": [[aud(20), aud(61)], [], [aud(400)]],
    "zero_feature_clip": [[aud(2), aud(100)], [aud(9)]],  # L=2: bos/eos, no placeholder
}


@pytest.mark.parametrize("name", sorted(ALIGNED))
def test_aligned_each_sample_equals_its_own_batch(model, name):
    samples = ALIGNED[name]
    b = fam.make_batch(model, samples)
    with torch.no_grad():
        hidden = model.model(**b.kwargs).last_hidden_state
    for s, sample in enumerate(samples):
        n = b.lengths[s]
        torch.testing.assert_close(hidden[s, :n], _own(model, sample), atol=1e-5, rtol=0)


# -- 3. unguarded -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "samples, n_tok, n_feat",
    [
        ([[aud(100, tokens=24)]], 24, 25),  # short run
        ([[aud(100, tokens=26)]], 26, 25),  # surplus
        ([[aud(100)], [aud(40, tokens=7)]], 32, 35),  # short in one sample of two
    ],
)
def test_unguarded_count_mismatch_raises(model, samples, n_tok, n_feat):
    b = fam.make_batch(model, samples)
    with pytest.raises(ValueError, match=f"tokens: {n_tok}, features: {n_feat}$"):
        model(**b.kwargs)


@pytest.mark.parametrize("k", [1, 3])
def test_unguarded_plus_minus_k_is_silent_and_moves_features(model, k):
    b = fam.make_batch(model, [[aud(100, tokens=25 + k)], [aud(40, tokens=10 - k)]])
    hidden, emb, proj = _run(model, b.kwargs)
    assert hidden.shape[:2] == b.input_ids.shape
    pos0 = (b.input_ids[0] == model.config.audio_token_id).nonzero().flatten()
    pos1 = (b.input_ids[1] == model.config.audio_token_id).nonzero().flatten()
    torch.testing.assert_close(emb[0, pos0[25:]], proj[1][:k])  # sample 1's clip in sample 0
    torch.testing.assert_close(emb[1, pos1], proj[1][k:10])


def test_unguarded_swap_is_silent_and_wrong(model):
    samples = [[aud(100)], [aud(40)]]  # 25 and 10 features
    b = fam.make_batch(model, samples, swap=(0, 1))
    hidden, emb, proj = _run(model, b.kwargs)
    pos0 = (b.input_ids[0] == model.config.audio_token_id).nonzero().flatten()
    # consumption order is the 40-frame clip first: sample 0 takes its 10 rows, then 15 of the other
    torch.testing.assert_close(emb[0, pos0], torch.cat([proj[0][:10], proj[1][:15]]))
    for s, sample in enumerate(samples):
        assert not torch.allclose(hidden[s, : b.lengths[s]], _own(model, sample), atol=1e-3)


@pytest.mark.parametrize(
    "samples, grown",
    [
        ([[aud(100, tokens=1)]], 24),  # one sample, its run cut to 1 placeholder
        ([[aud(100, tokens=1)], [aud(40, tokens=1)]], 24),  # both cut: rows padded to the longest
    ],
)
def test_unguarded_single_placeholder_runs_take_the_legacy_expansion(model, samples, grown):
    b = fam.make_batch(model, samples)
    with torch.no_grad():
        hidden = model.model(**b.kwargs).last_hidden_state  # no error: the legacy merge expands
    assert hidden.shape[1] == b.input_ids.shape[1] + grown


def test_unguarded_legacy_path_with_no_placeholder_raises(model):
    b = fam.make_batch(model, [[aud(100, tokens=0)]])
    with pytest.raises(ValueError, match="The number of audio tokens is tensor"):
        model(**b.kwargs)
