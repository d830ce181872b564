"""How media items appear in token ids, per model family (the presets below; docs/ARCHITECTURE.md).

A grammar only names token ids; the ids themselves come from the user's
tokenizer. Presets carry the published defaults where a family has fixed ids
(Qwen2-VL) and take the ids as arguments where they vary by checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..errors import MediaInputError


@dataclass(frozen=True)
class Grammar:
    """Placeholder grammar of one model family.

    placeholders: modality name -> placeholder token id (``{"image": 151655}``).
    start_id / end_id: region delimiters (``<|vision_start|>`` / ``<|vision_end|>``,
        ``<img>`` / ``</img>``, Pixtral's ``[IMG_END]`` as end only). When set, a
        placeholder outside a region and a region never closed are findings.
    break_ids: tokens that sit inside a run, occupy positions and are fed no
        feature (Pixtral's ``[IMG_BREAK]``).
    collapsed: one placeholder token stands for a whole item that the model
        expands itself (megatron-core LLaVA); each such token is its own run.
    regions: further ``(start, end)`` marker pairs beside ``start_id`` / ``end_id``, for
        families whose modalities have their own markers (Nemotron Omni's ``<img>``/``</img>``
        and ``<so_start>``/``<so_end>``). Every start opens a region, every end closes one.
    aliases: modalities that share another modality's placeholder token, ``{"video": "image"}``
        (Nemotron Omni's video tubelets, GLM-4V's video frames): their items match runs of that
        token, and keep their own name in reports and records.
    inner: of the marker pairs (``start_id``/``end_id`` and ``regions``), those whose region may
        also sit right inside a region of another pair, its start right after that region's
        start and its end right before that region's end (Qwen3-Omni's audio in video:
        ``<|vision_start|><|audio_start|>`` ... ``<|audio_end|><|vision_end|>``). Such nested
        markers are read as part of the outer region's markers: the outer region holds the
        runs of both modalities, and a nested start without its nested end (or the reverse)
        is a finding. Elsewhere the pair opens and closes regions as any other.
    text_id: a text token id of the tokenizer (e.g. its pad token), fed at the positions
        of placeholders the policy generated (``GuardConfig.generated="text"``). Only the
        parse reads it in :meth:`MediaGuard.merge` (whose embeddings are given: such a
        position keeps its given embedding); None: merge takes :meth:`neutral_text_id`.
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
        specials = [t for t in (self.start_id, self.end_id) if t is not None]
        specials += [t for pair in regions for t in pair]
        specials += list(self.break_ids)
        every = list(ids.values()) + specials
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
        if self.text_id is not None and (
            isinstance(self.text_id, bool) or not isinstance(self.text_id, int)
        ):
            raise MediaInputError(f"Grammar text_id must be an int or None, got {self.text_id!r}")
        if self.text_id is not None and self.text_id in every:
            raise MediaInputError(
                f"Grammar text_id {self.text_id} is one of the grammar's own tokens {every}: "
                "pass a text token id (e.g. the tokenizer's pad token)"
            )
        object.__setattr__(self, "placeholders", MappingProxyType(ids))
        object.__setattr__(self, "break_ids", tuple(self.break_ids))
        object.__setattr__(self, "regions", regions)
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

    @property
    def outer_start_ids(self) -> tuple[int, ...]:
        """The starts of the pairs that are not :attr:`inner` (an inner start nests after one)."""
        return tuple(t for t in self.start_ids if t not in {a for a, _ in self.inner})

    @property
    def outer_end_ids(self) -> tuple[int, ...]:
        return tuple(t for t in self.end_ids if t not in {b for _, b in self.inner})

    def token_modality(self, modality: str) -> str:
        """The modality whose placeholder token ``modality`` uses (itself unless aliased)."""
        return self.aliases.get(modality, modality)

    def neutral_text_id(self) -> int:
        """:attr:`text_id`, else the smallest non-negative id that is none of the grammar's
        tokens (enough for the parse, which only needs the position to read as text)."""
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
        """Qwen2-VL / 2.5-VL / 3-VL: ``<|vision_start|><|image_pad|>*N<|vision_end|>``.

        Qwen2/2.5 video is one run of t*a*b ``<|video_pad|>``; Qwen3-VL video is one
        run per temporal group (each its own item). Defaults are Qwen2-VL's ids
        (``text_id``: ``<|endoftext|>``, the tokenizer's pad token).
        """
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
        """Nemotron / InternVL / NVLM expanded: ``<img><image>*N</img>`` per image,
        tile group or video tubelet (video uses the same tokens)."""
        return cls(
            {"image": image_context},
            start_id=img_start,
            end_id=img_end,
            name="internvl",
            text_id=text_id,
        )

    @classmethod
    def pixtral(cls, img: int, img_break: int, img_end: int, text_id: int | None = None) -> Grammar:
        """Pixtral / Mistral: rows of ``[IMG]*cols [IMG_BREAK]``, the last break
        replaced by ``[IMG_END]``. Breaks get no feature."""
        return cls(
            {"image": img},
            end_id=img_end,
            break_ids=(img_break,),
            name="pixtral",
            text_id=text_id,
        )

    @classmethod
    def llava(cls, image_token: int = -200) -> Grammar:
        """megatron-core LLaVA collapsed: one image token per image (default id -200),
        expanded by the model to num_tiles * img_seq_len."""
        return cls({"image": image_token}, collapsed=True, name="llava")
