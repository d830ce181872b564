"""A tiny instance of Megatron-Bridge 0.6.2's real ``Qwen3OmniModel`` (and the
``Qwen3OmniThinkerModel`` it holds) on CPU (tests only), beside :mod:`.bridge_models`.

Call with :func:`megatron_media_guard.testing.bridge.install` in effect. Real: Bridge's
provider (``Qwen3OmniModelProvider``, tiny and dense, float32, holding ``full``'s thinker
config), ``provide()``, both classes' ``__init__`` (they build transformers' real Qwen3-Omni
vision and audio encoders from the tiny thinker config) and forwards, Bridge's rope. What
stands in:

- ``Qwen3VLGPTModel`` (swapped during construction: megatron-core's attention asks for a CUDA
  device): :class:`OmniLanguageModel`, transformers' tiny Qwen3-Omni text model of ``full``.
- ``audio_model._get_feat_extract_output_lengths`` (with ``audio=True``): Bridge 0.6.2 calls
  it as ``(_, output_lengths) = audio_model._get_feat_extract_output_lengths(lengths)`` (the
  method Qwen2.5-Omni's encoder has); transformers 5.x's Qwen3-Omni encoder has only the
  module function, so every audio call of the plain class raises ``AttributeError``. The
  builder binds that method, its lengths from transformers' function with the tower's own
  ``n_window``; ``audio=False`` leaves the class as released.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from .bridge_models import TinyLanguageModel, one_rank_groups
from .families.base import swapped

THINKER = "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model"
PROVIDER = "megatron.bridge.models.qwen_omni.qwen3_omni_provider"
HF = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"


class OmniLanguageModel(TinyLanguageModel):
    """:class:`TinyLanguageModel` on transformers' Qwen3-Omni text model, whose MoE block
    ``view``s its input: Bridge's ``[s, b, h]`` decoder input is handed on as a contiguous
    ``[b, s, h]`` (the values unchanged)."""

    def forward(self, decoder_input=None, **kw) -> torch.Tensor:
        bsh = decoder_input.transpose(0, 1).contiguous()
        return super().forward(decoder_input=bsh.transpose(0, 1), **kw)


def _bind_output_lengths(encoder: nn.Module) -> None:
    count = importlib.import_module(HF)._get_feat_extract_output_lengths

    def output_lengths(lengths: torch.Tensor):
        return lengths, count(lengths, encoder.n_window)

    encoder._get_feat_extract_output_lengths = output_lengths


def qwen3_omni(full: nn.Module, seed: int = 0, *, audio: bool = True) -> nn.Module:
    """Bridge's real ``Qwen3OmniModel`` from its real provider, eval mode (``full``: the tiny
    ``Qwen3OmniMoeThinkerForConditionalGeneration`` of
    :mod:`megatron_media_guard.testing.families.qwen3_omni`; its config is the provider's
    ``thinker_config``, its text model the language model). ``audio``: bind the encoder
    method Bridge's audio path calls (see the module doc)."""
    thinker_mod = importlib.import_module(THINKER)
    provider_mod = importlib.import_module(PROVIDER)
    t = full.config.text_config
    provider = provider_mod.Qwen3OmniModelProvider(
        thinker_config=full.config,
        num_layers=1,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_key_value_heads,
        kv_channels=t.head_dim,
        vocab_size=t.vocab_size,
        mrope_section=list(t.rope_parameters["mrope_section"]),
        num_moe_experts=None,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        bf16=False,
        params_dtype=torch.float32,
    )
    provider._pg_collection = one_rank_groups()

    def gpt_model(config, **kw):
        return OmniLanguageModel(full, config)

    torch.manual_seed(seed)
    with swapped(thinker_mod, Qwen3VLGPTModel=gpt_model):
        model = provider.provide(pre_process=True, post_process=True)
    if audio:
        _bind_output_lengths(model.thinker.audio_model)
    return model.eval()
