"""A STAND-IN for Kimi K2.5's remote-code ``modeling_kimi_k25.py`` (tests only).

This is not Moonshot's remote code. It is never imported from the package:
:func:`~megatron_media_guard.testing.bridge_models_kimi.write_hf_dir` copies this file, as
``modeling_kimi_k25.py``, into a local model directory beside a ``config.json``, and Bridge
0.6.2's ``KimiK25VLModel.__init__`` loads its classes from there with transformers'
``get_class_from_dynamic_module("modeling_kimi_k25.<Name>", hf_model_path,
trust_remote_code=True)``, as it loads the checkpoint's remote code (a local directory needs no
download). The classes are thin adapters over transformers 5.24's *native* Kimi K2.5 vision
tower and projector (``transformers.models.kimi_k25``): the tower's and the projector's
arithmetic is transformers', only the names and call signatures are the remote code's, as
Bridge calls them:

- ``VisionTowerConfig(vision_config)``: a copy of the checkpoint's vision config;
- ``ProjectorConfig(vision_config)``: the projector's sizes, read from the fields the remote
  vision config carries beside the tower's (``mm_hidden_size``, ``projector_ln_eps``,
  ``text_hidden_size``);
- ``MoonViT3dPretrainedModel(config)(pixel_values, grid_thws)``: transformers'
  ``Kimi_K25VisionModel``; per grid row its time-pooled ``[h*w/4, 4, hidden]`` block (what the
  remote ``tpool_patch_merger`` returns);
- ``PatchMergerMLP(config)(blocks)``: transformers' ``Kimi_K25MultimodalProjection`` over the
  blocks; per block ``[h*w/4, text_hidden]``;
- ``MoonViT3dEncoder``: the remote tower's block stack. The native tower holds its layers
  itself, so nothing builds this class; it is here because Bridge patches its ``__init__`` and
  class attributes (``use_deterministic_attn``) before it builds the tower.

Imports: torch and transformers only (transformers checks a remote module's imports).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
from transformers.models.kimi_k25.modeling_kimi_k25 import (
    Kimi_K25MultimodalProjection,
    Kimi_K25VisionModel,
)


def VisionTowerConfig(vision_config) -> Kimi_K25VisionConfig:  # the remote class name
    """The tower's config: a copy of the checkpoint's vision config (Bridge sets its
    attention implementation on it)."""
    return copy.deepcopy(vision_config)


class ProjectorConfig(SimpleNamespace):
    """What transformers' ``Kimi_K25MultimodalProjection`` reads, from the vision config."""

    def __init__(self, vision_config) -> None:
        super().__init__(
            vision_config=vision_config,
            projection_hidden_size=vision_config.mm_hidden_size,
            projection_layer_norm_eps=vision_config.projector_ln_eps,
            text_config=SimpleNamespace(hidden_size=vision_config.text_hidden_size),
        )


class MoonViT3dEncoder(nn.Module):
    """The remote tower's block stack; never built here (see the module doc)."""


class MoonViT3dPretrainedModel(Kimi_K25VisionModel):
    """transformers' native Kimi K2.5 vision tower, called as the remote tower is."""

    _supports_flash_attn_2 = True

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        pooled = super().forward(pixel_values, grid_thw=grid_thws).pooler_output
        kh, kw = self.merge_kernel_size
        sizes = (grid_thws[:, 1] * grid_thws[:, 2] // (kh * kw)).tolist()
        return list(pooled.split(sizes))


class PatchMergerMLP(nn.Module):
    """transformers' native Kimi K2.5 projector over the tower's per-item blocks."""

    def __init__(self, config: ProjectorConfig) -> None:
        super().__init__()
        self.proj = Kimi_K25MultimodalProjection(config)

    def forward(self, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self.proj(torch.cat(blocks)).squeeze(1)
        return list(out.split([len(b) for b in blocks]))
