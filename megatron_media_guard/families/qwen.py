"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE): positions follow
the grid rows (MRoPE) and Qwen3-VL injects deepstack features at the same positions, so these
are guarded by rewriting the forward's inputs before the tower
(:func:`~megatron_media_guard.adapters.qwen_vl.install.install_qwen_vl`, docs/QWEN_VL.md):
token ids and sizes come from ``model.config`` there.
"""

from __future__ import annotations

from .spec import FamilySpec

_HF = (
    "Qwen2VL",
    "Qwen2_5_VL",
    "Qwen3VL",
    "Qwen3VLMoe",
    "Qwen3_5",
    "Qwen3_5Moe",
)

SPEC = FamilySpec(
    name="qwen_vl",
    classes={
        "transformers.": frozenset(
            name for p in _HF for name in (f"{p}ForConditionalGeneration", f"{p}Model")
        ),
        "megatron.bridge.": frozenset({"Qwen25VLModel", "Qwen3VLModel"}),
    },
    modalities=(),
    apply="qwen_vl",
)
