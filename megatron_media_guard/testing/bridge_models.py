"""Tiny instances of Megatron-Bridge 0.6.2's real model classes on CPU (tests only).

Call with :func:`megatron_media_guard.testing.bridge.install` in effect. What is real and what
stands in:

- ``Qwen25VLModel``: Bridge's own provider (``Qwen25VLModelProvider``, a tiny config) and
  class; its ``__init__`` builds transformers' real Qwen2.5-VL vision tower from the tiny
  vision config. Only ``provide_language_model`` is replaced: megatron-core's ``GPTModel``
  attention needs CUDA, so the language model is :class:`TinyLanguageModel`.
- ``Qwen3VLModel``: Bridge's provider and class; its ``__init__`` runs with three names of its
  module swapped for the duration of the construction (they build Transformer Engine layers):
  ``get_vit_layer_with_transformer_engine_spec`` (a spec with the attribute it assigns),
  ``Qwen3VLVisionModel`` (transformers' real Qwen3-VL vision tower, called as Bridge calls
  its own: ``(hidden_states=, grid_thw=)`` -> ``(embeds, deepstack features)``) and
  ``Qwen3VLGPTModel`` (:class:`TinyLanguageModel`); the provider's
  ``get_gpt_layer_with_transformer_engine_spec`` likewise. The process groups are a
  one-rank stand-in (no ``torch.distributed``).
- ``GLM45VModel`` (:func:`glm45v`): Bridge's provider (tiny, dense, float32) and class; its
  ``__init__`` builds transformers' real GLM-4V vision tower; the language model is
  :class:`TinyLanguageModel` around transformers' tiny GLM-4V text model.
- ``Ernie45VLModel`` (:func:`ernie45_vl`): likewise (transformers' real Ernie 4.5 VL vision
  tower and resampler, built by Bridge's ``__init__``; Bridge's MoE decoder never built).
- ``NemotronVLModel`` / ``NemotronOmniModel``: Bridge's wrappers around megatron-core
  0.19.2's real ``LLaVAModel`` (:func:`nemotron`); stand-ins: the CLIP tower (swapped during
  construction; its ``__init__`` calls ``.cuda()``), the GPT decoder block (attention asks for
  a CUDA device) and the sound encoder. Everything else of the forward is the release's.

:class:`TinyLanguageModel` is the language-model contract Bridge's forwards call: ``embedding
(input_ids=, position_ids=)`` -> ``[s, b, h]``, ``forward(decoder_input=[s, b, h],
position_ids=[3, b, s], labels=, packed_seq_params=, visual_pos_masks=,
deepstack_visual_embeds=)`` -> the per-token loss ``[b, s]`` with labels, else logits
``[b, s, v]`` (GPTModel's outputs), decoding transformers' real tiny text model. THD
attention is emulated by decoding each packed sample alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from .families.base import swapped
from .qwen_vl import tiny_config, tiny_model

QWEN25 = "megatron.bridge.models.qwen_vl.modeling_qwen25_vl"
QWEN3 = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
NEMOTRON_VL = "megatron.bridge.models.nemotron_vl.modeling_nemotron_vl"
NEMOTRON_OMNI = "megatron.bridge.models.nemotron_omni.modeling_nemotron_omni"
GLM45V = "megatron.bridge.models.glm_vl.modeling_glm_45v"
ERNIE45VL = "megatron.bridge.models.ernie_vl.modeling_ernie45_vl.model"


def segments(packed_seq_params) -> list[tuple[int, int]]:
    """(start, length) of each packed sample: padded starts, unpadded lengths (as Bridge's
    ``unpack_mcore_thd_tensor_for_position_ids``)."""
    cu = packed_seq_params.cu_seqlens_q.tolist()
    padded = packed_seq_params.cu_seqlens_q_padded
    starts = padded.tolist()[:-1] if padded is not None else cu[:-1]
    return [(s, b - a) for s, a, b in zip(starts, cu[:-1], cu[1:])]


def _deepstack_part(kw: dict, s: int, n: int) -> dict:
    """The deepstack inputs of one packed sample: its mask columns and its vision rows."""
    mask = kw.get("visual_pos_masks")
    if mask is None or not kw.get("deepstack_visual_embeds"):
        return {}
    before, within = int(mask[:, :s].sum()), int(mask[:, s : s + n].sum())
    if not within:
        return {}
    rows = slice(before, before + within)
    return {
        "visual_pos_masks": mask[:, s : s + n],
        "deepstack_visual_embeds": [e[rows] for e in kw["deepstack_visual_embeds"]],
    }


class TinyLanguageModel(nn.Module):
    """The language model Bridge's Qwen-VL forwards call (see the module doc)."""

    def __init__(self, full: nn.Module, config=None) -> None:
        """``full``: transformers' tiny ``Qwen*VLForConditionalGeneration``; its text model
        and head. ``config``: the Bridge config the real language model would hold."""
        super().__init__()
        self.config = config
        self.lm = full.model.language_model
        self.output_layer = full.lm_head
        self.rotary_pos_emb = SimpleNamespace(is_thd_format=False)
        self.decoder = SimpleNamespace(layers=list(self.lm.layers))
        self.share_embeddings_and_output_weights = False

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.output_layer.weight

    def set_input_tensor(self, input_tensor) -> None:
        pass

    def embedding(self, input_ids: torch.Tensor, position_ids=None) -> torch.Tensor:
        return self.lm.get_input_embeddings()(input_ids).transpose(0, 1)

    def forward(
        self,
        input_ids=None,
        position_ids=None,
        attention_mask=None,
        decoder_input=None,
        labels=None,
        loss_mask=None,
        runtime_gather_output=None,
        packed_seq_params=None,
        inference_params=None,
        **kw,
    ) -> torch.Tensor:
        emb = decoder_input.transpose(0, 1)  # [b, s, h]
        deep = {k: kw[k] for k in ("visual_pos_masks", "deepstack_visual_embeds") if k in kw}
        if deep.get("deepstack_visual_embeds") is None:
            deep = {}
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            hidden = self.lm(inputs_embeds=emb, position_ids=position_ids, **deep)
            hidden = hidden.last_hidden_state
        else:  # THD: every packed sample attends only to itself
            hidden = torch.zeros_like(emb)
            for s, n in segments(packed_seq_params):
                sl = slice(s, s + n)
                part = _deepstack_part(deep, s, n)
                out = self.lm(inputs_embeds=emb[:, sl], position_ids=position_ids[:, :, sl], **part)
                hidden[:, sl] = out.last_hidden_state
        logits = self.output_layer(hidden)
        if labels is None:
            return logits
        ce = nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten().clamp(min=0), reduction="none"
        )
        return ce.view(labels.shape)


class _OneRank:
    """A one-rank process group: what Bridge's forwards ask of ``pg_collection.*``."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def one_rank_groups() -> SimpleNamespace:
    g = _OneRank()
    return SimpleNamespace(tp=g, cp=g, pp=g, dp=g, embd=None)


class _VisionTower(nn.Module):
    """transformers' Qwen3-VL vision tower behind Bridge's ``Qwen3VLVisionModel`` call."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, hidden_states, grid_thw):
        out = self.visual(hidden_states, grid_thw=grid_thw)
        return out.pooler_output, list(out.deepstack_features)


def _text_sizes(family: str) -> dict:
    t = tiny_config(family).text_config
    return dict(
        num_layers=t.num_hidden_layers,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_key_value_heads,
        vocab_size=t.vocab_size,
        mrope_section=[2, 3, 3],
    )


def qwen25_vl(seed: int = 0) -> nn.Module:
    """Bridge's real ``Qwen25VLModel`` from its real provider (tiny config), eval mode."""
    import importlib

    provider_mod = importlib.import_module("megatron.bridge.models.qwen_vl.qwen25_vl_provider")

    class Provider(provider_mod.Qwen25VLModelProvider):
        def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
            return TinyLanguageModel(tiny_model("qwen2_5_vl", seed=seed))

    provider = Provider(
        vision_config=tiny_config("qwen2_5_vl").vision_config, **_text_sizes("qwen2_5_vl")
    )
    torch.manual_seed(seed)
    return provider.provide(pre_process=True, post_process=True).eval()


def _spec(*_args, **_kwargs) -> SimpleNamespace:
    return SimpleNamespace(submodules=SimpleNamespace(self_attention=SimpleNamespace(module=None)))


def qwen3_vl(seed: int = 0) -> nn.Module:
    """Bridge's real ``Qwen3VLModel`` from its real provider (tiny config), eval mode; the
    Transformer Engine pieces of its construction swapped (see the module doc)."""
    import importlib

    model_mod = importlib.import_module(QWEN3)
    provider_mod = importlib.import_module("megatron.bridge.models.qwen_vl.qwen3_vl_provider")
    hf = tiny_config("qwen3_vl")
    full = tiny_model("qwen3_vl", seed=seed)

    def vision_model(config, layer_spec, merger_spec, **kw):
        return _VisionTower(full.model.visual)

    def gpt_model(config, **kw):
        return TinyLanguageModel(full, config)

    provider = provider_mod.Qwen3VLModelProvider(
        vision_config=hf.vision_config,
        deepstack_visual_indexes=list(hf.vision_config.deepstack_visual_indexes),
        patch_size=hf.vision_config.patch_size,
        spatial_merge_size=hf.vision_config.spatial_merge_size,
        **_text_sizes("qwen3_vl"),
    )
    provider._pg_collection = one_rank_groups()
    with (
        swapped(provider_mod, get_gpt_layer_with_transformer_engine_spec=_spec),
        swapped(
            model_mod,
            get_vit_layer_with_transformer_engine_spec=_spec,
            Qwen3VLVisionModel=vision_model,
            Qwen3VLGPTModel=gpt_model,
        ),
    ):
        model = provider.provide(pre_process=True, post_process=True)
    return model.eval()


# ---- Nemotron VL / Omni: Bridge's wrappers around a real megatron-core LLaVAModel ----------


class TinyViT(nn.Module):
    """Stands in for megatron-core's ``CLIPViTModel`` (its ``__init__`` calls ``.cuda()``):
    a patch convolution and a class token, ``[tiles, 3, H, W]`` -> ``[tiles, 1 + patches, h]``,
    with the attributes ``LLaVAModel.forward`` reads."""

    def __init__(self, config, layer_spec, *, img_h, img_w, class_token_len, patch_dim, **kw):
        super().__init__()
        self.class_token_len, self.patch_dim = class_token_len, patch_dim
        self.add_class_token = kw.get("add_class_token", True)
        h = config.hidden_size
        self.conv = nn.Conv2d(3, h, patch_dim, patch_dim, bias=False)
        self.class_token = nn.Parameter(torch.randn(1, class_token_len, h))

    def set_input_tensor(self, input_tensor) -> None:
        pass

    def forward(self, images: torch.Tensor, **kw) -> torch.Tensor:
        patches = self.conv(images).flatten(2).transpose(1, 2)
        return torch.cat([self.class_token.expand(len(images), -1, -1), patches], 1)


class TinyDecoder(nn.Module):
    """Stands in for the ``TransformerBlock`` of megatron-core's ``GPTModel`` (its attention
    asks ``torch.cuda.current_device()``): one per-token layer, so each position's output
    depends on its own embedding only."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def set_input_tensor(self, input_tensor) -> None:
        pass

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kw) -> torch.Tensor:
        return torch.tanh(self.lin(hidden_states))


class TinySound(nn.Module):
    """A sound encoder as 0.19.2's ``LLaVAModel.forward`` calls it: ``(clips [n, frames,
    mel], lengths)`` -> ``([n, rows, h], rows per clip)``, rows = frames halved (rounding up)
    three times (Parakeet's subsampling)."""

    def __init__(self, mel: int, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(mel, hidden)

    @staticmethod
    def rows(frames: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            frames = (frames + 1) // 2
        return frames.clamp(min=1)

    def forward(self, sound_clips: torch.Tensor, sound_length: torch.Tensor):
        return self.lin(sound_clips[:, ::8].float()), self.rows(sound_length)


def nemotron(
    kind: str = "omni",
    *,
    image_token: int = 12,
    sound_token: int = 14,
    hidden: int = 32,
    vocab: int = 128,
    max_len: int = 256,
    mel: int = 8,
    seed: int = 0,
) -> nn.Module:
    """Bridge's real ``NemotronOmniModel`` (``kind="omni"``, with a sound encoder) or
    ``NemotronVLModel`` around megatron-core's real ``LLaVAModel`` (tiny configs, 28x28 tiles
    of 14-pixel patches: 4 embeddings per tile), eval mode. Real: the wrapper, LLaVAModel's
    ``__init__`` / ``forward`` / ``_preprocess_data``, the ``MultimodalProjector``, GPTModel's
    embedding, output layer and loss; stand-ins: the CLIP tower (swapped during
    construction), the GPT decoder block and the sound encoder (see their classes). Needs
    megatron-core's model-parallel state (one gloo rank will do)."""
    import importlib

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    llava_mod = importlib.import_module("megatron.core.models.multimodal.llava_model")
    wrapper = importlib.import_module(NEMOTRON_OMNI if kind == "omni" else NEMOTRON_VL)
    cfg = dict(num_attention_heads=2, use_cpu_initialization=True)
    lang = TransformerConfig(num_layers=1, hidden_size=hidden, **cfg)
    vision = TransformerConfig(num_layers=1, hidden_size=16, **cfg)
    vision.vision_model_type = "clip"
    proj = TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=hidden, **cfg)
    torch.manual_seed(seed)
    sound = dict(
        sound_model=TinySound(mel, 16),
        sound_projection=nn.Linear(16, hidden),
        sound_token_index=sound_token,
    )
    with swapped(llava_mod, CLIPViTModel=TinyViT):
        llava = llava_mod.LLaVAModel(
            lang,
            get_gpt_layer_local_spec(),
            vocab,
            max_len,
            vision,
            get_vit_layer_with_local_spec(),
            True,  # drop_vision_class_token
            proj,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            img_h=28,
            img_w=28,
            patch_dim=14,
            image_token_index=image_token,
            **(sound if kind == "omni" else {}),
        )
    llava.language_model.decoder = TinyDecoder(hidden)
    cls = wrapper.NemotronOmniModel if kind == "omni" else wrapper.NemotronVLModel
    return cls(llava_model=llava).eval()


def _mrope_vl(provider_cls, full: nn.Module, seed: int, **extra) -> nn.Module:
    """Bridge's real class from a subclass of its real provider ``provider_cls`` (tiny, dense,
    float32: ``full``'s vision config, token ids and text sizes), eval mode; its language
    model :class:`TinyLanguageModel` around ``full``."""

    class Provider(provider_cls):
        def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
            return TinyLanguageModel(full)

    c, t = full.config, full.config.text_config
    ids = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id")
    ids += ("video_start_token_id", "video_end_token_id")
    f32 = dict(bf16=False, params_dtype=torch.float32, autocast_dtype=torch.float32)
    provider = Provider(
        vision_config=c.vision_config,
        num_layers=1,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_key_value_heads,
        kv_channels=t.hidden_size // t.num_attention_heads,
        vocab_size=t.vocab_size,
        mrope_section=list(t.rope_parameters["mrope_section"]),
        **{k: getattr(c, k) for k in ids},
        **f32,
        **extra,
    )
    provider._pg_collection = one_rank_groups()
    torch.manual_seed(seed)
    return provider.provide(pre_process=True, post_process=True).eval()


def glm45v(full: nn.Module, seed: int = 0) -> nn.Module:
    """Bridge's real ``GLM45VModel`` from its real ``GLM45VModelProvider`` (``full``: the tiny
    ``Glm4vForConditionalGeneration``; its MoE and MTP defaults turned off)."""
    import importlib

    mod = importlib.import_module("megatron.bridge.models.glm_vl.glm_45v_provider")
    dense = dict(num_moe_experts=None, moe_layer_freq=1, mtp_num_layers=None)
    dense.update(moe_grouped_gemm=False, moe_permute_fusion=False, moe_shared_expert_overlap=False)
    return _mrope_vl(mod.GLM45VModelProvider, full, seed, **dense)


def ernie45_vl(full: nn.Module, seed: int = 0) -> nn.Module:
    """Bridge's real ``Ernie45VLModel`` from its real ``Ernie45VLModelProvider`` (``full``: the
    tiny ``Ernie4_5_VLMoeForConditionalGeneration``, whose config Bridge's resampler reads)."""
    import importlib

    mod = importlib.import_module("megatron.bridge.models.ernie_vl.ernie45_vl_provider")
    return _mrope_vl(mod.Ernie45VLModelProvider, full, seed, hf_config=full.config)
