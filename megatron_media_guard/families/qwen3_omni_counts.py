"""Qwen3-Omni thinker's audio ``counts`` from its inputs (both specs: transformers' and
Bridge's; their grid rows: :func:`.qwen.grid_counts`): per clip the tower's output length of its
mel frames; torch ops on the inputs' device (:func:`~.spec.count_table`)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..errors import MediaInputError
from .spec import attr_path, count_table

_HF = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"


def clip_tokens(config: Any, kw) -> torch.Tensor:
    """Per clip, the tower's output length of its mel frames (transformers'
    ``_get_feat_extract_output_lengths``, torch ops) from ``feature_attention_mask`` (else
    ``audio_feature_lengths``), the tower's ``n_window`` (the thinker config's; Bridge's provider
    holds it as ``thinker_config``; 50, the function's default, where neither says)."""
    mask, lengths = kw.get("feature_attention_mask"), kw.get("audio_feature_lengths")
    frames = mask.sum(-1) if mask is not None else lengths
    if frames is None:
        raise MediaInputError(
            "qwen3_omni: input_features without feature_attention_mask or "
            "audio_feature_lengths (the forward needs one of them too)"
        )
    n_window = attr_path(config, "thinker_config.audio_config.n_window", "audio_config.n_window")
    count = importlib.import_module(_HF)._get_feat_extract_output_lengths
    return count(frames.long(), int(n_window or 50))


def audio_counts(config: Any, kw) -> torch.Tensor:
    """Per clip its :func:`clip_tokens`; ``use_audio_in_video`` refused."""
    if kw.get("use_audio_in_video"):
        raise MediaInputError(
            "qwen3_omni: use_audio_in_video=True interleaves video and audio placeholders in "
            "one region; the inputs alone do not attribute those runs (check it in the model: "
            "install_vlm)"
        )
    return count_table(clip_tokens(config, kw))
