"""Tiny instances of Megatron-Bridge 0.6.2's real ``Gemma3VLModel`` and ``Qwen2AudioModel`` on
CPU (tests only): Bridge's classes around transformers' towers, beside :mod:`.bridge_models`.

Call with :func:`megatron_media_guard.testing.bridge.install` in effect. Both ``__init__`` and
forward are the release's; the config is a stand-in with the provider's attribute names (the
providers' ``provide_language_model`` builds megatron-core's ``GPTModel``, whose attention needs
CUDA). What stands in:

- ``Gemma3VLModel``: Transformer Engine's ``TENorm`` in Bridge's own projector (swapped during
  construction), the projector's one-rank collectives (skipped), and the language model
  (:class:`Gemma3LanguageModel`: transformers' tiny Gemma 3 text model under the attention biases
  Bridge computes). Its SigLIP tower is Bridge's own ``AutoModel.from_config``.
- ``Qwen2AudioModel``: only the language model (:class:`~.bridge_models.TinyLanguageModel`); the
  audio encoder and projector are transformers', built by Bridge's ``__init__``.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn

from .bridge_models import TinyLanguageModel, one_rank_groups

GEMMA3_VL = "megatron.bridge.models.gemma_vl.modeling_gemma3_vl"
QWEN2_AUDIO = "megatron.bridge.models.qwen_audio.modeling_qwen2_audio"


class _ZeroCenteredRMSNorm(nn.Module):
    """Stands in for Transformer Engine's ``TENorm`` in Bridge's Gemma 3 projector (RMSNorm
    with ``layernorm_zero_centered_gamma``: ``x * (1 + w)``, as transformers' Gemma3RMSNorm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3LanguageModel(TinyLanguageModel):
    """:class:`TinyLanguageModel` for ``Gemma3VLModel``: Bridge hands its (local, global)
    attention biases as ``extra_block_kwargs={"attention_bias": ...}``; they reach transformers'
    Gemma 3 text model as its per-layer-type masks (sliding / full), so the image blocks'
    bidirectional attention Bridge computes from ``input_ids`` is the one decoded."""

    def forward(self, decoder_input=None, position_ids=None, labels=None, **kw):
        emb = decoder_input.transpose(0, 1)
        bias = (kw.get("extra_block_kwargs") or {}).get("attention_bias")
        mask = None if bias is None else {"sliding_attention": bias[0], "full_attention": bias[1]}
        hidden = self.lm(inputs_embeds=emb, position_ids=position_ids, attention_mask=mask)
        logits = self.output_layer(hidden.last_hidden_state)
        if labels is None:
            return logits
        ce = nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten().clamp(min=0), reduction="none"
        )
        return ce.view(labels.shape)


def gemma3_vl(full: nn.Module, seed: int = 0) -> nn.Module:
    """Bridge's real ``Gemma3VLModel`` (its ``__init__`` and forward), eval mode: its own
    SigLIP tower (``AutoModel.from_config`` of ``full``'s tiny vision config) and its own
    ``Gemma3VLMultimodalProjector`` (Transformer Engine's ``TENorm`` swapped for
    :class:`_ZeroCenteredRMSNorm` during construction); the language model
    :class:`Gemma3LanguageModel` on ``full`` (transformers' tiny ``Gemma3ForConditionalGeneration``).
    The config is a stand-in with the provider's attribute names."""
    import copy
    import importlib

    mod = importlib.import_module(GEMMA3_VL)
    hf = full.config
    vc = copy.deepcopy(hf.vision_config)
    proj = mod.Gemma3VLMultimodalProjectorConfig(
        input_size=vc.hidden_size,
        hidden_size=hf.text_config.hidden_size,
        image_size=vc.image_size,
        patch_dim=vc.patch_size,
        tokens_per_image=hf.mm_tokens_per_image,
        use_cpu_initialization=True,
    )
    cfg = SimpleNamespace(
        vision_config=vc,
        vision_projector_config=proj,
        mm_tokens_per_image=hf.mm_tokens_per_image,
        image_token_id=hf.image_token_id,
        vision_start_token_id=hf.boi_token_index,
        vision_end_token_id=hf.eoi_token_index,
        pad_token_id=hf.text_config.pad_token_id,
        window_size=hf.text_config.sliding_window,
        return_dict=True,  # the provider's field; transformers' get_image_features reads it
        params_dtype=torch.float32,
        share_embeddings_and_output_weights=False,
        sequence_parallel=False,
        _pg_collection=one_rank_groups(),
        provide_language_model=lambda **kw: Gemma3LanguageModel(full),
    )
    torch.manual_seed(seed)
    with mock.patch.object(mod, "TENorm", _ZeroCenteredRMSNorm):
        model = mod.Gemma3VLModel(cfg)
    proj = model.multi_modal_projector.proj
    # one rank: its collectives (the output's all-gather, the input grad's all-reduce) are
    # identities, but megatron-core asks torch.distributed for the group (None without it)
    # before it looks at the size: both are skipped
    proj.gather_output, proj.disable_grad_reduce = False, True
    with torch.no_grad():  # drawn at unit scale, as the fixture's transformers projector
        proj.weight.normal_(0.0, proj.weight.shape[1] ** -0.5)
    return model.eval()


def qwen2_audio(full: nn.Module) -> nn.Module:
    """Bridge's real ``Qwen2AudioModel`` (its ``__init__`` builds transformers' real audio
    encoder and projector from ``full``'s tiny config), eval mode; the language model
    :class:`TinyLanguageModel` on ``full`` (transformers' tiny
    ``Qwen2AudioForConditionalGeneration``). The config is a stand-in with the provider's
    attribute names."""
    import importlib

    mod = importlib.import_module(QWEN2_AUDIO)
    hf = full.config
    cfg = SimpleNamespace(
        hf_config=hf,
        audio_token_id=hf.audio_token_id,
        pad_token_id=hf.text_config.pad_token_id,
        share_embeddings_and_output_weights=False,
        provide_language_model=lambda **kw: TinyLanguageModel(full),
    )
    torch.manual_seed(0)
    return mod.Qwen2AudioModel(cfg).eval()
