"""How media items appear in token ids, per model family. A grammar only names ids (the
user's tokenizer has them); presets carry published defaults where a family fixes them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..errors import MediaInputError


@dataclass(frozen=True)
class Grammar:
    """Placeholder grammar of one model family.

    placeholders: modality name -> placeholder token id (``{"image": 151655}``).
    start_id / end_id: region delimiters (``<|vision_start|>`` / ``<|vision_end|>``; Pixtral's
        ``[IMG_END]`` as end only): a placeholder outside a region, a region never closed
        are findings. regions: further ``(start, end)`` pairs (Nemotron Omni's ``<img>`` and
        ``<so_start>`` pairs).
    break_ids: tokens inside a run that take no feature (Pixtral's ``[IMG_BREAK]``).
    collapsed: one token stands for a whole item the model expands (megatron-core LLaVA).
    aliases: modalities that use another's placeholder token, ``{"video": "image"}``: their
        items match that token's runs and keep their own name in reports.
    inner: marker pairs whose region may also sit right inside another pair's, start after
        start and end before end (Qwen3-Omni's audio in video): read as the outer region's
        markers, and a nested start without its nested end is a finding (``runs.py``).
    text_id: a text token id (the pad token) fed where the policy generated a placeholder
        (``GuardConfig.generated="text"``); None: :meth:`neutral_text_id`.
    """

    placeholders: Mapping[str, int]
    start_id: int | None = None
    end_id: int | None = None
    break_ids: tuple[int, ...] = ()
    collapsed: bool = False
    name: str = field(default="custom", compare=False)
    regions: tuple[tuple[int, int], ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    text_id: int | None = field(default=None, compare=False)
    inner: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.placeholders:
            raise MediaInputError("Grammar needs at least one placeholder token id")
        ids = dict(self.placeholders)
        for modality, tok in ids.items():
            if not isinstance(modality, str) or not modality:
                raise MediaInputError(f"Grammar modality names must be strings, got {modality!r}")
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise MediaInputError(
                    f"Grammar placeholder id for {modality!r} must be an int, got {tok!r}"
                )
        regions = tuple((int(a), int(b)) for a, b in self.regions)
        if regions and (self.start_id is None or self.end_id is None):
            raise MediaInputError("Grammar regions extend start_id / end_id: set both first")
        object.__setattr__(self, "regions", regions)
        every = [*ids.values(), *self.start_ids, *self.end_ids, *self.break_ids]
        if len(set(every)) != len(every):
            raise MediaInputError(f"Grammar token ids must be distinct, got {every}")
        if self.break_ids and len(ids) > 1:
            raise MediaInputError(
                "a grammar with break tokens takes one placeholder modality: a run could "
                f"change modality across a break unnoticed (got {list(ids)})"
            )
        if self.collapsed and (self.start_id is not None or self.break_ids):
            raise MediaInputError("a collapsed grammar has no start token or breaks")
        inner = tuple((int(a), int(b)) for a, b in self.inner)
        pairs = [(self.start_id, self.end_id), *regions]
        if any(p not in pairs for p in inner) or len(set(inner)) >= len(pairs):
            raise MediaInputError(
                f"Grammar inner pairs {list(inner)} must be marker pairs of the grammar "
                f"({pairs}), and at least one pair must stay outer"
            )
        aliases = dict(self.aliases)
        for alias, target in aliases.items():
            if alias in ids or target not in ids:
                raise MediaInputError(
                    f"Grammar alias {alias!r} -> {target!r} must name a new modality and one "
                    f"with a placeholder (placeholders: {list(ids)})"
                )
        text = self.text_id
        if text is not None and (isinstance(text, bool) or not isinstance(text, int)):
            raise MediaInputError(f"Grammar text_id must be an int or None, got {text!r}")
        if text is not None and text in every:
            raise MediaInputError(
                f"Grammar text_id {text} is one of the grammar's own tokens {every}: "
                "pass a text token id (e.g. the tokenizer's pad token)"
            )
        object.__setattr__(self, "placeholders", MappingProxyType(ids))
        object.__setattr__(self, "break_ids", tuple(self.break_ids))
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "aliases", MappingProxyType(aliases))

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modality names in a fixed order; index i is the modality code used on device."""
        return tuple(self.placeholders)

    @property
    def start_ids(self) -> tuple[int, ...]:
        """Every token that opens a region (``start_id`` first)."""
        return () if self.start_id is None else (self.start_id, *(a for a, _ in self.regions))

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every token that closes a region (``end_id`` first)."""
        return () if self.end_id is None else (self.end_id, *(b for _, b in self.regions))

    def token_modality(self, modality: str) -> str:
        """The modality whose placeholder token ``modality`` uses (itself unless aliased)."""
        return self.aliases.get(modality, modality)

    def neutral_text_id(self) -> int:
        """:attr:`text_id`, else the smallest non-negative id none of the grammar's tokens is
        (the parse only needs the position to read as text)."""
        if self.text_id is not None:
            return self.text_id
        own = {*self.placeholders.values(), *self.break_ids, *self.start_ids, *self.end_ids}
        return next(t for t in range(len(own) + 1) if t not in own)

    def modality_code(self, modality: str) -> int:
        try:
            return self.modalities.index(self.aliases.get(modality, modality))
        except ValueError:
            raise MediaInputError(
                f"modality {modality!r} is not in grammar {self.name!r} "
                f"(has {[*self.modalities, *self.aliases]})"
            ) from None

    # ---- presets -----------------------------------------------------------

    @classmethod
    def qwen2_vl(
        cls,
        image_pad: int = 151655,
        video_pad: int = 151656,
        vision_start: int = 151652,
        vision_end: int = 151653,
        text_id: int | None = 151643,
    ) -> Grammar:
        """Qwen2-VL / 2.5-VL / 3-VL: ``<|vision_start|><|image_pad|>*N<|vision_end|>`` (Qwen3-VL
        video: one run per temporal group). Defaults: Qwen2-VL's ids, ``<|endoftext|>`` text."""
        return cls(
            {"image": image_pad, "video": video_pad},
            start_id=vision_start,
            end_id=vision_end,
            name="qwen2_vl",
            text_id=text_id,
        )

    @classmethod
    def internvl(
        cls, image_context: int, img_start: int, img_end: int, text_id: int | None = None
    ) -> Grammar:
        """Nemotron / InternVL / NVLM expanded: ``<img><image>*N</img>`` per image or tubelet."""
        return cls(
            {"image": image_context},
            start_id=img_start,
            end_id=img_end,
            name="internvl",
            text_id=text_id,
        )

    @classmethod
    def pixtral(cls, img: int, img_break: int, img_end: int, text_id: int | None = None) -> Grammar:
        """Pixtral / Mistral: rows of ``[IMG]*cols [IMG_BREAK]``, the last break ``[IMG_END]``."""
        return cls(
            {"image": img},
            end_id=img_end,
            break_ids=(img_break,),
            name="pixtral",
            text_id=text_id,
        )

    @classmethod
    def llava(cls, image_token: int = -200) -> Grammar:
        """megatron-core LLaVA: one image token per image, expanded by the model."""
        return cls({"image": image_token}, collapsed=True, name="llava")
