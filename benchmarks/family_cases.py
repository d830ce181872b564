"""The batches ``bench_families`` times: per family fixture (``testing/families/``) a batch of 4
samples of about ``S`` tokens each, the family's media as its ``make_batch`` sizes them
(``Media.size`` per the fixture's docstring) and text filling each row up to ``S``.

Items are sized like the real checkpoints' (about 250-1800 placeholders an item) so that the
runs, items and features per sample are those of a realistic long prompt; the towers stay tiny.
Three fixtures cap an item at a few tokens with module constants (Gemma 3's 32 px tower and 4
tokens an image, InternVL's 56 px tiles of 4 tokens, Qwen3.5's 128 x 128 px ``max_pixels``):
the benchmark sets those constants to the real checkpoints' values (256 tokens an image, 448 px
tiles of 256 tokens, ``max_pixels`` 1024 x 1024) while it builds the model and the batch, and
restores them after; LLaVA-OneVision gets a 224 px tower through ``tiny_model``'s overrides.
Mistral 3 (Pixtral) gets 448 px images: its tower attends over every image of the call at once
with a dense block mask (patches squared), so 16 images of 1024 patches is what CPU memory holds.

``label`` "images": images (audio clips for Qwen2-Audio) only, the aligned path's common case;
"mixed": every modality the family has in each sample (the extra transfers of a mixed call).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from megatron_media_guard import MediaItem
from megatron_media_guard.testing.families.base import FamilyBatch, Media, swapped

#: (family fixture, label) in the table's order
FAMILIES = (
    "nemotron_omni",
    "qwen3_5",
    "gemma3",
    "glm4v",
    "mistral3",
    "qwen3_omni",
    "qwen2_audio",
    "internvl",
    "llava_onevision",
    "kimi_k25",
    "ernie4_5_vl",
)


def _img(*size: int) -> Media:
    return Media("image", size)


@dataclass(frozen=True)
class Case:
    """One benchmark batch: ``media`` of one sample (every sample gets the same list, text
    fills it to the length), ``consts`` fixture module constants set while building, ``model``
    keyword overrides of ``tiny_model``."""

    family: str
    label: str
    media: tuple[Media, ...]
    consts: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)


def tokenizer(family: str) -> dict[str, int] | None:
    """Marker ids the tiny configs lack, as ``{token text: id}`` for ``install_vlm`` (the
    tokenizer-only markers the fixtures write; the family tests pass the same)."""
    F = fixture(family)
    known = {
        "nemotron_omni": lambda: {
            "<img>": F.IMG_START, "</img>": F.IMG_END,
            "<so_start>": F.SO_START, "<so_end>": F.SO_END,
        },
        "mistral3": lambda: {"[IMG_BREAK]": F.BREAK_ID, "[IMG_END]": F.END_ID},
        "internvl": lambda: {"<img>": F.IMG_START, "</img>": F.IMG_END},
        "qwen3_omni": lambda: {"<|vision_end|>": F.VISION_END, "<|audio_end|>": F.AUDIO_END},
    }  # fmt: skip
    return known[family]() if family in known else None


_LLAVA_TILE = 224
_LLAVA = dict(
    vision_config={"image_size": _LLAVA_TILE},
    image_grid_pinpoints=[
        [_LLAVA_TILE * i, _LLAVA_TILE * j] for i in range(1, 7) for j in range(1, 7)
    ],
)
_GEMMA = {"IMAGE_SIZE": 256, "MM_TOKENS": 256}  # 32 x 32 patches of 8 px, pooled to 16 x 16
_INTERNVL = {"TILE": 448, "SEQ": 256}  # 32 x 32 patches of 14 px, pixel-shuffled to 16 x 16
_QWEN35 = {"MAX_PIXELS": 1024 * 1024}


def cases(quick: bool = False) -> list[Case]:
    """The full table (``quick``: one small images case per family, same code paths)."""
    if quick:
        small = {
            "nemotron_omni": (_img(8, 8),),
            "qwen3_5": (_img(64, 64),),
            "gemma3": (_img(40, 40),),
            "glm4v": (_img(4, 4),),
            "mistral3": (_img(56, 56),),
            "qwen3_omni": (_img(4, 4),),
            "qwen2_audio": (Media("audio", (200,)),),
            "internvl": (_img(56, 56),),
            "llava_onevision": (_img(56, 56), _img(56, 56)),
            "kimi_k25": (_img(4, 4),),
            "ernie4_5_vl": (_img(4, 4),),
        }
        return [Case(f, "small", small[f]) for f in FAMILIES]
    audio = [Media("audio", (L,)) for L in (3000, 2400, 1800, 3000, 1200, 3000, 2600, 3000, 2000)]
    return [
        Case("nemotron_omni", "images", (_img(64, 64),) * 7),
        Case(
            "nemotron_omni",
            "mixed",
            (_img(64, 64),) * 6 + (Media("audio", (4000,)),),
        ),
        Case("qwen3_5", "images", (_img(896, 896),) * 9, consts=_QWEN35),
        Case(
            "qwen3_5",
            "mixed",
            (_img(896, 896),) * 6 + (Media("video", (8, 448, 448)),) * 2,
            consts=_QWEN35,
        ),
        Case("gemma3", "images", (_img(300, 400),) * 26, consts=_GEMMA),
        Case("glm4v", "images", (_img(64, 64),) * 7),
        Case("mistral3", "images", (_img(448, 448),) * 4),
        Case("qwen3_omni", "images", (_img(64, 64),) * 7),
        Case(
            "qwen3_omni",
            "mixed",
            (_img(64, 64),) * 4 + (Media("video", (4, 32, 32)), Media("audio", (3000,))) * 2,
        ),
        Case("qwen2_audio", "audio", tuple(audio)),
        Case("internvl", "images", (_img(672, 896),) * 4, consts=_INTERNVL),
        Case(
            "internvl", "mixed", (_img(672, 896),) * 3 + (Media("video", (6,)),), consts=_INTERNVL
        ),
        Case("llava_onevision", "images", (_img(600, 800),) * 24, model=_LLAVA),
        Case("llava_onevision", "mixed", (_img(600, 800), Media("video", (32,))), model=_LLAVA),
        Case("kimi_k25", "images", (_img(64, 64),) * 7),
        Case("kimi_k25", "mixed", (_img(64, 64),) * 5 + (Media("video", (8, 32, 32)),) * 2),
        Case("ernie4_5_vl", "images", (_img(64, 64),) * 7),
        Case("ernie4_5_vl", "mixed", (_img(64, 64),) * 5 + (Media("video", (8, 32, 32)),) * 2),
    ]


def fixture(family: str):
    return importlib.import_module(f"megatron_media_guard.testing.families.{family}")


def set_items(case: Case, batch: FamilyBatch) -> list[MediaItem] | None:
    """What the collate gives ``set_items`` where the family needs it for per-item checks
    (InternVL: the tiles per image never reach the model; one item per image, ``SEQ`` x its
    tiles, one per video frame, as ``tests/test_family_internvl.py`` gives them); else None."""
    if case.family != "internvl":
        return None
    seq = case.consts.get("SEQ", fixture("internvl").SEQ)
    out = []
    for s, mod, n in batch.items:
        sizes = [n] if mod == "image" else [seq] * (n // seq)
        out += [MediaItem(x, sample=s, modality="image") for x in sizes]
    return out


def build(case: Case, seq: int) -> tuple[Any, FamilyBatch]:
    """The tiny model and a batch of 4 samples of ``case.media``, text filling the longest row
    to about ``seq`` tokens (``text_len`` solved from two small builds: the length is linear
    in it)."""
    F = fixture(case.family)
    k = len(case.media)
    samples = [list(case.media[s % k :] + case.media[: s % k]) for s in range(4)]  # rotated
    with swapped(F, **case.consts):
        model = F.tiny_model(**case.model)
        one = [list(case.media)]
        a = F.make_batch(model, one, text_len=1).lengths[0]
        b = F.make_batch(model, one, text_len=2).lengths[0]
        text_len = max(1, round(1 + (seq - a) / max(1, b - a)))
        return model, F.make_batch(model, samples, text_len=text_len)
