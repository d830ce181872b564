"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE; transformers' and Bridge's
``Qwen25VLModel`` / ``Qwen3VLModel``), ``apply="inputs"``: docs/QWEN_VL.md, docs/FAMILIES.md."""

from __future__ import annotations

from typing import Any

import torch

from ..core.grammar import Grammar
from ..geometry import PatchMergeGeometry
from .common import grid_table, hf_classes
from .spec import FamilySpec, ModalitySpec, Token, attr_path, model_encodes, tower_zeros


def is_qwen3(obj: Any) -> bool:
    """A Qwen3-VL / 3.5 model or config (a run per temporal group; patch 16), by its
    ``model_type`` or class name."""
    return any(
        str(getattr(o, "model_type", "") or "").startswith("qwen3")
        or type(o).__name__.startswith("Qwen3")
        for o in (obj, getattr(obj, "config", None))
    )


def sizes(model_or_config: Any) -> dict[str, int]:
    """``patch``, ``merge``, ``temporal_patch`` of the vision tower (``vision_config``, a whole
    Qwen3-Omni config's thinker's, or Bridge's top-level names), else the family defaults."""
    cfg = getattr(model_or_config, "config", model_or_config)
    default = {"patch": 16 if is_qwen3(model_or_config) else 14, "merge": 2, "temporal_patch": 2}
    names = ("patch_size", "spatial_merge_size", "temporal_patch_size")
    got = (
        attr_path(cfg, f"vision_config.{n}", f"thinker_config.vision_config.{n}", n) for n in names
    )
    return {k: int(v or default[k]) for k, v in zip(default, got)}


def geometry(model: Any) -> PatchMergeGeometry | dict[str, PatchMergeGeometry]:
    """The repair geometry: the processors' default pixel budgets (Qwen3-VL's image and video
    ones) at the vision config's sizes."""
    s = sizes(model)
    if is_qwen3(model):
        video = PatchMergeGeometry.qwen3_vl_video(**s)
        return {"image": PatchMergeGeometry.qwen3_vl(**s), "video": video}
    return PatchMergeGeometry.qwen2_vl(**s)


def grid_counts(kind: str, per_group: bool = True):
    """One run of t*h*w/merge**2 per ``{kind}_grid_thw`` row at :func:`sizes`; Qwen3-VL / 3.5
    videos t runs of h*w/merge**2 (``per_group``; Qwen3-Omni's, not: one run over t *
    temporal_patch frames)."""

    def counts(config: Any, kw) -> torch.Tensor:
        s, video = sizes(config), kind == "video"
        t = "runs" if video and per_group and is_qwen3(config) else "tokens"
        frames = s["temporal_patch"] if video and not per_group else 0
        return grid_table(kw[f"{kind}_grid_thw"], s["merge"] ** 2, s["patch"], t, frames)

    return counts


def derive(name: str, ids: torch.Tensor, grammar: Grammar) -> torch.Tensor:
    """What the ids say ``name`` must be: ``mm_token_type_ids`` 0 text / 1 image / 2 video
    (int32), or Bridge's boolean ``image_input_mask`` / ``video_input_mask``."""
    image, video = (grammar.placeholders.get(k, -1) for k in ("image", "video"))
    if name.endswith("_input_mask"):
        return ids == (image if name == "image_input_mask" else video)
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt.masked_fill_(ids == image, 1)
    return tt.masked_fill_(ids == video, 2)


def dummy(model: Any) -> Any:
    """The vision tower on one ``merge x merge`` cell of zeros (the smallest input it takes);
    None without a tower here (a pipeline stage)."""
    tower = attr_path(model, "visual", "model.visual", "vision_model")
    if tower is None:
        return None
    s = sizes(model)
    m = s["merge"]
    cfg = getattr(model, "config", None)
    channels = attr_path(cfg, "vision_config.in_channels", "vision_config.in_chans") or 3
    cell = tower_zeros(model, tower, m * m, int(channels) * s["temporal_patch"] * s["patch"] ** 2)
    grid = torch.tensor([[1, m, m]], dtype=torch.long).to(cell.device, non_blocking=True)
    try:
        return tower(cell, grid_thw=grid)
    except TypeError:  # Bridge's Qwen3-VL vision model takes keywords only
        return tower(hidden_states=cell, grid_thw=grid)


_VISION = dict(
    start=Token(("vision_start_token_id",), "<|vision_start|>", 151652),
    end=Token(("vision_end_token_id",), "<|vision_end|>", 151653),
)

SPEC = FamilySpec(
    name="qwen_vl",
    classes={
        **hf_classes("Qwen2VL", "Qwen2_5_VL", "Qwen3VL", "Qwen3VLMoe", "Qwen3_5", "Qwen3_5Moe"),
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
            counts=grid_counts("image"),
            **_VISION,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|video_pad|>", 151656),
            ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
            model_encodes,
            rows=("video_grid_thw", "second_per_grid_ts"),
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=grid_counts("video"),
            **_VISION,
        ),
    ),
    text=Token(("pad_token_id", "text_config.pad_token_id"), "<|endoftext|>", 151643),
    geometry=geometry,
    follow_ids=("mm_token_type_ids", "image_input_mask", "video_input_mask"),
    apply="inputs",
    dummy=dummy,
    derive=derive,
)
