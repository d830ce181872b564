"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration`` / ``Qwen2AudioModel``; Bridge
``Qwen2AudioModel``): ``input_features`` ``[n, mel, 3000]``; grammar and counts:
docs/FAMILIES.md. The model has no ``get_audio_features``: the encode runs its modules as its
forward does. Its legacy path (a placeholder expanded into its clip) never runs under the
guard: a run of one placeholder is a short run.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .common import PAD, hf_classes, mel_frames
from .spec import Encoded, FamilySpec, ModalitySpec, Token, count_table, tower_zeros


def _parts(model: Any):
    """(audio tower, projector): on the model itself (Bridge, transformers' ``Qwen2AudioModel``)
    or on its ``.model`` (``...ForConditionalGeneration``)."""
    inner = model if hasattr(model, "audio_tower") else model.model
    return inner.audio_tower, inner.multi_modal_projector


def _encode_audio(model: Any, kw) -> Encoded:
    tower, proj = _parts(model)
    device = tower.conv1.weight.device
    x = kw["input_features"].to(device)
    frames = mel_frames(x, kw.get("feature_attention_mask")).to(device)
    conv_len, out_len = tower._get_feat_extract_output_lengths(frames)
    s = (x.shape[-1] - 2) // 2 + 1
    valid = torch.arange(s, device=device)[None, :] < conv_len[:, None]  # a clip's frames
    # the tower's attention mask over its conv positions, as the model's forward builds it
    make = sys.modules[type(tower).__module__].create_bidirectional_mask
    embeds = torch.zeros((*valid.shape, 1), dtype=proj.linear.weight.dtype, device=device)
    mask = make(config=tower.config, inputs_embeds=embeds, attention_mask=valid.long())
    feats = proj(tower(x, attention_mask=mask).last_hidden_state)
    # the projector's rows are padded to the longest clip: each clip's count (on the device)
    # cuts its own once the merge's one transfer brings it (Encoded.counts)
    return Encoded((feats,), counts=out_len)


def _counts(config: Any, kw) -> torch.Tensor:
    """Per clip ``((L - 1) // 2 + 1 - 2) // 2 + 1`` of its L mel frames (the tower's
    ``_get_feat_extract_output_lengths``; the whole window without a mask)."""
    frames = mel_frames(kw["input_features"], kw.get("feature_attention_mask"))
    n = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    return count_table(n.clamp(min=0))


def _dummy(model: Any):
    """One clip of zeros through the encode: a full window (the tower takes only its fixed
    ``2 * max_source_positions`` mel frames)."""
    tower = _parts(model)[0]
    frames = 2 * tower.config.max_source_positions
    x = tower_zeros(model, tower, 1, tower.config.num_mel_bins, frames)
    return _encode_audio(model, {"input_features": x}).features


SPEC = FamilySpec(
    name="qwen2_audio",
    classes=hf_classes("Qwen2Audio"),
    modalities=(
        ModalitySpec(
            "audio",
            Token(("audio_token_id", "audio_token_index"), "<|AUDIO|>", 151646),
            ("input_features", "feature_attention_mask"),
            _encode_audio,
            start=Token((), "<|audio_bos|>", 151647),
            end=Token((), "<|audio_eos|>", 151648),
            rows=("input_features", "feature_attention_mask"),
            counts=_counts,
        ),
    ),
    text=Token(PAD, "<|endoftext|>", 151643),
    dummy=_dummy,
)

#: Megatron-Bridge 0.6.2 ``Qwen2AudioModel``: it merges audio whenever ``input_features`` is
#: given: the engine passes the audio inputs as None once merged (neither is in ``keep``)
BRIDGE = SPEC.bridge("Qwen2AudioModel")
