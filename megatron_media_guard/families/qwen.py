"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE): transformers'
``...ForConditionalGeneration`` / ``...Model`` and Megatron-Bridge's ``Qwen25VLModel`` /
``Qwen3VLModel``.

- image: ``<|vision_start|>`` ``<|image_pad|>``x(t*h*w/merge**2) ``<|vision_end|>``;
  ``pixel_values`` ``[sum(t*h*w), C*tp*p*p]`` patch rows with ``image_grid_thw`` (t, h, w).
- video: Qwen2-VL / 2.5-VL one such run of ``<|video_pad|>`` per video (t*h*w/merge**2);
  Qwen3-VL / 3.5 one run of h*w/merge**2 per temporal group, each after its timestamp text
  (the video is the groups' model-level item); ``pixel_values_videos`` with ``video_grid_thw``.

Every item's count is a pure function of its grid row, which also drives MRoPE and (Qwen3-VL)
the deepstack injections, so the spec is ``apply="inputs"``: the forward's inputs are checked
and rewritten before the vision tower (``adapters/vlm_inputs.py``, docs/QWEN_VL.md), and the
data-side check (:func:`~.collate.check_batch`) sizes the items from the grids alone.
``mm_token_type_ids`` (transformers) and ``image_input_mask`` / ``video_input_mask``
(Bridge) follow the ids (:func:`derive`); :func:`dummy` runs the vision tower on one cell. Token ids and sizes from
``model.config`` (Bridge's provider holds the same names), else the Qwen2 tokenizer's ids.
Repair geometry (:func:`geometry`) from the vision config: patch, merge and temporal patch of
the model, the pixel budgets of the processor's defaults.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.grammar import Grammar
from ..geometry import PatchMergeGeometry
from .mrope import grid_counts
from .spec import FamilySpec, ModalitySpec, Token, attr_path, model_encodes

_HF = (
    "Qwen2VL",
    "Qwen2_5_VL",
    "Qwen3VL",
    "Qwen3VLMoe",
    "Qwen3_5",
    "Qwen3_5Moe",
)


def is_qwen3(obj: Any) -> bool:
    """A Qwen3-VL / 3.5 model or config (videos one run per temporal group; patch 16): its
    ``model_type`` (``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5``, ...) or class name (Bridge's
    ``Qwen3VLModel`` and its ``Qwen3VLModelProvider``)."""
    cfg = getattr(obj, "config", None)
    for o in (obj, cfg):
        if o is None:
            continue
        if str(getattr(o, "model_type", "") or "").startswith("qwen3"):
            return True
        if type(o).__name__.startswith("Qwen3"):
            return True
    return False


def sizes(model_or_config: Any) -> dict[str, int]:
    """``patch``, ``merge``, ``temporal_patch`` of the model's vision tower: its config's
    ``vision_config`` (transformers; Bridge's provider holds the same, and its own top-level
    names), else the family defaults (patch 14, or 16 for Qwen3-VL; merge 2; 2 frames)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    names = {
        "patch": "patch_size",
        "merge": "spatial_merge_size",
        "temporal_patch": "temporal_patch_size",
    }
    default = {"patch": 16 if is_qwen3(model_or_config) else 14, "merge": 2, "temporal_patch": 2}
    out = {}
    for key, name in names.items():
        v = attr_path(cfg, f"vision_config.{name}", name)
        out[key] = int(v) if v is not None else default[key]
    return out


def geometry(model: Any) -> PatchMergeGeometry | dict[str, PatchMergeGeometry]:
    """The repair geometry of ``model``: the processor's default pixel budgets
    (``PatchMergeGeometry.qwen2_vl()``; Qwen3-VL's image and video processors' own, the video
    one with its temporal budget) with the patch, merge and temporal patch of the model's
    vision config."""
    s = sizes(model)
    if is_qwen3(model):
        return {
            "image": PatchMergeGeometry.qwen3_vl(**s),
            "video": PatchMergeGeometry.qwen3_vl_video(**s),
        }
    return PatchMergeGeometry.qwen2_vl(**s)


def _counts(kind: str):
    """One run of t*h*w/merge**2 per grid row; Qwen3-VL videos t runs of h*w/merge**2."""

    def counts(config: Any, kw) -> list[list[int]]:
        per_run = kind == "video" and is_qwen3(config)
        s = sizes(config)
        return grid_counts(f"{kind}_grid_thw", per_run, s["merge"] ** 2, s["patch"])(config, kw)

    return counts


def derive(name: str, ids: torch.Tensor, grammar: Grammar) -> torch.Tensor:
    """What the ids say ``name`` must be: ``mm_token_type_ids`` 0 text / 1 image / 2 video
    (int32), or Bridge's boolean ``image_input_mask`` / ``video_input_mask``."""
    image = grammar.placeholders.get("image", -1)
    video = grammar.placeholders.get("video", -1)
    if name == "image_input_mask":
        return ids == image
    if name == "video_input_mask":
        return ids == video
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt.masked_fill_(ids == image, 1)
    return tt.masked_fill_(ids == video, 2)


def vision_tower(model: Any) -> Any:
    """The vision tower of a transformers or Megatron-Bridge Qwen-VL model (None if not here:
    a pipeline stage without it)."""
    return attr_path(model, "visual", "model.visual", "vision_model")


def dummy(model: Any) -> Any:
    """The model's own vision tower on one ``merge x merge`` cell of zeros (grid
    ``[[1, merge, merge]]``: the smallest input it takes), in the tower's parameter dtype
    (``keep_tower``); None when the model has no tower here."""
    tower = vision_tower(model)
    if tower is None:
        return None
    p = next((p for p in tower.parameters() if p.is_floating_point()), None)
    dtype = p.dtype if p is not None else torch.float32
    device = p.device if p is not None else torch.device("cpu")
    s = sizes(model)
    cfg = getattr(model, "config", None)
    channels = attr_path(cfg, "vision_config.in_channels", "vision_config.in_chans")
    dim = (3 if channels is None else int(channels)) * s["temporal_patch"] * s["patch"] ** 2
    m = s["merge"]
    cell = torch.zeros(m * m, dim, dtype=dtype, device=device)
    grid = torch.tensor([[1, m, m]], dtype=torch.long).to(device, non_blocking=True)
    try:
        return tower(cell, grid_thw=grid)
    except TypeError:  # Bridge's Qwen3-VL vision model takes keywords only
        return tower(hidden_states=cell, grid_thw=grid)


_VISION = dict(
    start=Token(("vision_start_token_id",), "<|vision_start|>", 151652),
    end=Token(("vision_end_token_id",), "<|vision_end|>", 151653),
)
_TYPES = ("mm_token_type_ids", "image_input_mask", "video_input_mask")

SPEC = FamilySpec(
    name="qwen_vl",
    classes={
        "transformers.": frozenset(
            name for p in _HF for name in (f"{p}ForConditionalGeneration", f"{p}Model")
        ),
        "megatron.bridge.": frozenset({"Qwen25VLModel", "Qwen3VLModel"}),
    },
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<|image_pad|>", 151655),
            ("pixel_values", "image_grid_thw"),
            model_encodes,
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=_counts("image"),
            **_VISION,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|video_pad|>", 151656),
            ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
            model_encodes,
            rows=("video_grid_thw", "second_per_grid_ts"),
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=_counts("video"),
            **_VISION,
        ),
    ),
    text=Token(("pad_token_id", "text_config.pad_token_id"), "<|endoftext|>", 151643),
    geometry=geometry,
    follow_ids=_TYPES,
    apply="inputs",
    dummy=dummy,
    derive=derive,
)
