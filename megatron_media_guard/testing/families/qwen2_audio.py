"""Qwen2-Audio (transformers ``Qwen2AudioForConditionalGeneration``): tiny model and batches.

Grammar (``Qwen2AudioProcessor``): ``<|audio_bos|>`` ``<|AUDIO|>`` x N ``<|audio_eos|>`` per clip,
N from the clip's mel frames L (``feature_attention_mask`` row sum):
``N = ((L - 1) // 2 + 1 - 2) // 2 + 1`` (= ``(L + 1) // 4``; L <= 2 gives N = 0: a bos/eos pair with
no placeholder). The config knows only ``audio_token_id`` (151646, alias ``audio_token_index``); the
markers are the Qwen2 tokenizer's ``<|audio_bos|>`` 151647 / ``<|audio_eos|>`` 151648, pad
``<|endoftext|>`` 151643.

The ids are built here from that arithmetic; ``tests/test_family_qwen2_audio.py`` checks them
against the real ``Qwen2AudioProcessor`` (a ``WhisperFeatureExtractor``, numpy, and an in-memory
word-level tokenizer holding the real special ids: no download).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import FamilyBatch, Media, right_pad, rng

FAMILY = "qwen2_audio"

AUDIO_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
PAD_ID, BOS_ID, EOS_ID = 151643, 151647, 151648
TEXT_IDS = (100, 1000)  # ordinary Qwen2 ids, clear of every special id
VOCAB = 151680  # > every special id (Qwen2-Audio-7B's is 156032)
HOP, SAMPLING_RATE = 160, 16000  # WhisperFeatureExtractor: one mel frame per 160 samples


def tiny_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random 1-layer Whisper-style audio encoder (d_model 32, 128 mel bins, the default
    ``max_source_positions`` 1500, so ``input_features`` are ``[n, 128, 3000]`` as the processor
    writes them) and a 1-layer Qwen2 LM (hidden 32, vocab 151680), float32, eval.
    ``overrides``: top-level ``Qwen2AudioConfig`` fields; ``audio_config`` / ``text_config``
    dicts are merged into the tiny defaults."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    audio = dict(
        model_type="qwen2_audio_encoder", d_model=32, encoder_layers=1, encoder_attention_heads=2,
        encoder_ffn_dim=64, num_mel_bins=128,
    )  # fmt: skip
    text = dict(
        model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB, pad_token_id=PAD_ID,
    )  # fmt: skip
    audio.update(overrides.pop("audio_config", {}))
    text.update(overrides.pop("text_config", {}))
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, **overrides)
    torch.manual_seed(seed)
    return Qwen2AudioForConditionalGeneration(config).eval().float()


def mel_frames(n_samples: int, max_frames: int = 3000) -> int:
    """``WhisperFeatureExtractor``'s ``attention_mask`` sum for a clip of ``n_samples`` at 16 kHz
    (padding "max_length" to 30 s): ``min(ceil(n_samples / 160), 3000)``."""
    return min(-(-n_samples // HOP), max_frames)


def num_features(frames: int) -> int:
    """Placeholders / features of a clip of ``frames`` mel frames: the audio tower's
    ``_get_feat_extract_output_lengths``: ``((L - 1) // 2 + 1 - 2) // 2 + 1``."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def max_frames(model: torch.nn.Module) -> int:
    """The fixed mel length the tower takes: ``max_source_positions * 2`` (3000)."""
    return model.config.audio_config.max_source_positions * 2


def _text(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(*TEXT_IDS, (n,), generator=gen).tolist()


def make_batch(
    model: torch.nn.Module,
    samples: Sequence[Sequence[Media]],
    *,
    text_len: int = 6,
    swap: tuple[int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """``Media("audio", (L,))``: the clip's mel frames L, 1 <= L <= :func:`max_frames` (use
    :func:`mel_frames` for a clip's sample count).

    Row of a sample: ``text_len`` text ids, then per clip ``<|audio_bos|>``, its placeholders,
    ``<|audio_eos|>`` and ``text_len`` text ids. ``input_features`` ``[n, 128, 3000]`` float32
    (random on the clip's L frames, 0 beyond; the extractor writes log-mel of silence there, which
    the tower's mask hides except at the conv edge), ``feature_attention_mask`` ``[n, 3000]`` int32
    (1 on the first L frames), both in token order over the batch (the model's consumption order).
    A clip's features and the text ids depend only on ``seed``, its sample's media and its place
    in the sample. ``swap=(i, j)`` exchanges the ``input_features`` and ``feature_attention_mask``
    rows of items ``i``, ``j``; ``items`` then describe the kwargs, ``runs`` the ids.
    Omits the audio kwargs when there is no clip.
    """
    audio_id, frames_max = model.config.audio_token_id, max_frames(model)
    mel = model.config.audio_config.num_mel_bins
    rows: list[list[int]] = []
    runs: list[list[tuple[str, int]]] = []
    feats: list[torch.Tensor] = []
    lengths: list[int] = []
    items: list[tuple[int, str, int]] = []
    for s, sample in enumerate(samples):
        key = tuple((m.modality, m.size) for m in sample)
        gen = rng(seed, key)
        row, sample_runs = _text(gen, text_len), []
        for k, media in enumerate(sample):
            if media.modality != "audio" or len(media.size) != 1:
                raise ValueError(f"qwen2_audio takes Media('audio', (L,)), got {media}")
            (frames,) = media.size
            if not 1 <= frames <= frames_max:
                raise ValueError(f"mel frames {frames} outside [1, {frames_max}]")
            n = num_features(frames)
            n_ids = n if media.tokens is None else media.tokens
            row += [BOS_ID, *[audio_id] * n_ids, EOS_ID, *_text(gen, text_len)]
            sample_runs.append(("audio", n_ids))
            x = torch.zeros((mel, frames_max))
            x[:, :frames] = torch.randn((mel, frames), generator=rng(seed, key, k))
            feats.append(x)
            lengths.append(frames)
            items.append((s, "audio", n))
        rows.append(row)
        runs.append(sample_runs)
    if swap is not None:
        i, j = swap
        for seq in (feats, lengths):
            seq[i], seq[j] = seq[j], seq[i]
        items[i], items[j] = (
            (items[i][0], "audio", items[j][2]),
            (items[j][0], "audio", items[i][2]),
        )
    ids, mask = right_pad(rows, PAD_ID)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if feats:
        kwargs["input_features"] = torch.stack(feats)
        frame = torch.arange(frames_max)[None, :]
        kwargs["feature_attention_mask"] = (frame < torch.tensor(lengths)[:, None]).to(torch.int32)
    return FamilyBatch(kwargs, items, runs, [len(r) for r in rows])
