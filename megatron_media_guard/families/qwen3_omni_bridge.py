"""Qwen3-Omni thinker on Megatron-Bridge 0.6.2: ``Qwen3OmniThinkerModel`` (found inside its
``Qwen3OmniModel`` wrapper, whose forward calls ``self.thinker(...)`` with keywords).

Its forward takes no ``inputs_embeds`` and merges by batch totals (what that does to a wrong
run, measured: docs/FAMILIES.md), so the spec is ``apply="inputs"``, sized by
``qwen.grid_counts`` and ``qwen3_omni_counts``. A dropped sample's patch, grid and
``video_second_per_grid`` rows leave the call; its audio clips stay (no ``rows``): with no
placeholder left in its row Bridge's trim takes none of their features, and rows and clips stay
paired for its per-row ``zip`` and its rope (it counts audio start markers). Ids from the
model's config; no repair geometry; ``use_audio_in_video`` refused.
"""

from __future__ import annotations

from .qwen import grid_counts
from .qwen3_omni_counts import audio_counts
from .spec import FamilySpec, ModalitySpec, Token, model_encodes

_VISION = dict(
    start=Token(("vision_start_token_id",), "<|vision_start|>"),
    end=Token(("vision_end_token_id",), "<|vision_end|>"),
)
_VIDEO = ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")
_AUDIO = ("input_features", "feature_attention_mask", "audio_feature_lengths")

SPEC = FamilySpec(
    name="qwen3_omni",
    classes={"megatron.bridge.": frozenset({"Qwen3OmniThinkerModel"})},
    modalities=(
        ModalitySpec(
            "image",
            Token(("image_token_id",), "<|image_pad|>"),
            ("pixel_values", "image_grid_thw"),
            model_encodes,
            rows=("image_grid_thw",),
            patches={"pixel_values": "image_grid_thw"},
            counts=grid_counts("image"),
            **_VISION,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|video_pad|>"),
            _VIDEO,
            model_encodes,
            rows=_VIDEO[1:],
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=grid_counts("video", per_group=False),
            **_VISION,
        ),
        ModalitySpec(
            "audio",
            Token(("audio_token_id",), "<|audio_pad|>"),
            _AUDIO,
            model_encodes,
            start=Token(("audio_start_token_id",), "<|audio_start|>"),
            end=Token(("audio_end_token_id",), "<|audio_end|>"),
            counts=audio_counts,
        ),
    ),
    text=Token(
        ("thinker_config.text_config.pad_token_id", "text_config.pad_token_id", "pad_token_id"),
        "<|endoftext|>",
        151643,
    ),
    apply="inputs",
)
