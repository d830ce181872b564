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

from dataclasses import replace

from . import qwen3_omni
from .spec import FamilySpec, Token, model_encodes

_VISION = dict(
    start=Token(("vision_start_token_id",), "<|vision_start|>"),
    end=Token(("vision_end_token_id",), "<|vision_end|>"),
)
_INPUTS = dict(encode=model_encodes, keep=())  # the model encodes its own media
_AUDIO, _IMAGE, _VIDEO = qwen3_omni.SPEC.modalities

#: transformers' modalities with Bridge's markers (every id from its config), in its order, no
#: audio in video
SPEC = FamilySpec(
    name="qwen3_omni",
    classes={"megatron.bridge.": frozenset({"Qwen3OmniThinkerModel"})},
    modalities=(
        replace(_IMAGE, **_VISION, **_INPUTS),
        replace(_VIDEO, inputs=_VIDEO.inputs[:3], **_VISION, **_INPUTS),  # no use_audio_in_video
        replace(
            _AUDIO,
            end=Token(("audio_end_token_id",), "<|audio_end|>"),
            rows=(),  # a dropped sample's clips stay (above)
            nests=False,
            **_INPUTS,
        ),
    ),
    text=Token(
        ("thinker_config.text_config.pad_token_id", "text_config.pad_token_id", "pad_token_id"),
        "<|endoftext|>",
        151643,
    ),
    apply="inputs",
)
