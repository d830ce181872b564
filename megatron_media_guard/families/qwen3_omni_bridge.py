"""Qwen3-Omni thinker on Megatron-Bridge 0.6.2: ``Qwen3OmniThinkerModel`` (found inside its
``Qwen3OmniModel`` wrapper, whose forward calls ``self.thinker(...)`` with keywords).

Its forward takes no ``inputs_embeds``: it encodes, then merges image and video features by
batch totals (``_trim_feature_sequence`` silently cuts the tail of the batch's features to
the placeholder count; ``masked_scatter_``), and audio by zipping per-*row* placeholder
counts with per-*clip* lengths (``strict=True``; each clip cut to its row's count). Measured
on the real forward (tiny, CPU; tests/test_family_qwen3_omni_bridge.py): a short image run or
a +k/-k (or a swap of two different-sized items) across samples runs silently with features
in the wrong rows; a short audio run silently loses its clip's last features; a row with
more placeholders than features raises a ``ValueError`` naming no sample; a batch whose rows
do not hold one clip each raises in the ``zip``, aligned or not.

So the spec is ``apply="inputs"``: items sized from the inputs (image / video
``t*h*w/merge**2`` per grid row, one run per video; audio per clip by transformers'
``_get_feat_extract_output_lengths`` of its mel frames, from ``feature_attention_mask`` as
the forward prefers, else ``audio_feature_lengths``), the plan applied to the inputs. A
dropped sample's patch rows, grid rows and ``video_second_per_grid`` leave the call; its
audio clips stay (no ``rows``): with no placeholder left in its row, Bridge's per-row trim
takes none of their features, and rows and clips stay paired for the zip and for Bridge's
rope, which counts audio start markers (a clip taken out makes it index past the lengths). Token ids from the model's config (Bridge's
provider holds them all); no repair geometry. ``use_audio_in_video`` is not attributed.
"""

from __future__ import annotations

from .qwen3_omni_counts import audio_counts, vision_counts
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
            counts=vision_counts("image"),
            **_VISION,
        ),
        ModalitySpec(
            "video",
            Token(("video_token_id",), "<|video_pad|>"),
            _VIDEO,
            model_encodes,
            rows=_VIDEO[1:],
            patches={"pixel_values_videos": "video_grid_thw"},
            counts=vision_counts("video"),
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
