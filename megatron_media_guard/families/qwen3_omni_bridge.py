"""Qwen3-Omni thinker on Megatron-Bridge 0.6.2: ``Qwen3OmniThinkerModel`` (found inside its
``Qwen3OmniModel`` wrapper). Its forward takes no ``inputs_embeds``: ``apply="inputs"``; why a
dropped sample's audio clips stay, and what the plain forward does: docs/FAMILIES.md.
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
