"""A model family as data (:class:`FamilySpec`, read by the engine ``adapters/vlm.py``): its
tokens (``model.config`` attribute paths, else a tokenizer token), the forward keywords that
carry each modality, and an ``encode`` that calls the model's *own* feature method (one feature
tensor per item, in the model's order). Everything else is the shared core.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ..core.grammar import Grammar
from ..errors import MediaInputError

ModalityName = Literal["image", "video", "audio"]
Apply = Literal["embed", "inputs", "llava", "mimo"]


def attr_path(obj: Any, *names: str) -> Any:
    """The first of the dotted attribute paths ``names`` that is set on ``obj`` (else None)."""
    for name in names:
        cur = obj
        for part in name.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                break
        if cur is not None:
            return cur
    return None


def check_tokenizer(tokenizer: Any, caller: str) -> None:
    """Refuses a ``tokenizer=`` that is neither None, a ``{token text: id}`` mapping, nor has
    ``convert_tokens_to_ids`` (most often a model name given as a string)."""
    lookup = getattr(tokenizer, "convert_tokens_to_ids", None)
    if tokenizer is None or isinstance(tokenizer, Mapping) or callable(lookup):
        return
    what = repr(tokenizer) if isinstance(tokenizer, str) else f"a {type(tokenizer).__name__}"
    raise MediaInputError(
        f"{caller}: tokenizer={what} cannot look up token ids: pass the tokenizer object "
        "(anything with convert_tokens_to_ids, e.g. AutoTokenizer.from_pretrained(name)) or a "
        "{token text: id} mapping",
        context={"caller": caller, "tokenizer": type(tokenizer).__name__},
    )


@dataclass(frozen=True)
class Token:
    """Where one token id comes from: the first dotted ``config`` path set on ``model.config``,
    else the tokenizer's id of ``text``, else ``default``."""

    config: tuple[str, ...] = ()
    text: str | None = None
    default: int | None = None

    def resolve(self, model: Any, tokenizer: Any = None) -> int | None:
        check_tokenizer(tokenizer, "the family's token lookup")
        cur = attr_path(getattr(model, "config", None), *self.config)
        if cur is not None:
            if isinstance(cur, (list, tuple)):  # e.g. eos_token_id lists
                cur = cur[0]
            return int(cur)
        if self.text is not None and isinstance(tokenizer, Mapping):  # {token text: id}
            tid = tokenizer.get(self.text)
            if tid is not None:
                return int(tid)
        elif self.text is not None and tokenizer is not None:
            tid = tokenizer.convert_tokens_to_ids(self.text)
            unk = getattr(tokenizer, "unk_token_id", None)
            if isinstance(tid, int) and tid >= 0 and tid != unk:
                return tid
        return self.default


@dataclass(frozen=True)
class Encoded:
    """What a modality's ``encode`` returns for one call: one ``[n_i, h]`` feature tensor per
    item in the model's order, and per item what diagnostics and repair need. The fields on
    the device are read with the merge's one transfer."""

    features: tuple[torch.Tensor, ...]
    # "items": one [sum, h] block the engine cuts by set_items' num_features, else by the runs
    # in the ids (only the total checked; InternVL: tiles per image never reach the model)
    split: Literal["items"] | None = None
    num_frames: tuple[int | None, ...] = ()
    frame_hw: tuple[tuple[int, int] | None, ...] = ()
    pixels: tuple[torch.Tensor | None, ...] = ()  # layout "image": [C, H, W] for repair
    parent: tuple[int, ...] = ()  # per item: index of the model-level item (video -> tubelets)
    # per item its sample on the device where the ids tie it there (Qwen3-Omni's audio in
    # video; -1 for every item or none), read with the verdict; set_items takes precedence
    sample: torch.Tensor | None = None
    output: Any = None  # the model's own feature output, for FamilySpec.reuse
    grid: tuple[tuple[int, int, int] | None, ...] = ()  # per item: its (t, h, w) feature grid
    spans: tuple[int, ...] = ()  # per model-level item: its dim-0 rows in ``rows`` (default 1)
    # per item its feature count on the device (an audio clip's, from its mask): ``features``
    # is one [sum(n_i), h] or padded [items, max, h] block, cut by them (:func:`cut_counted`)
    counts: torch.Tensor | None = None
    # per item its runs on the device, each an equal share of its features (GLM-4V's video:
    # its temporal groups' frame runs), or ``[items, w]``: each run's length, zero past the
    # item's runs (Qwen3-Omni's audio in video): checked in the merge, each item cut into them
    runs: torch.Tensor | None = None
    # the family's own refusal on the device: a 0-d int (nonzero: refused) and what raises
    # then (Qwen3-Omni's video region holding audio without use_audio_in_video)
    check: tuple[torch.Tensor, Callable[[], None]] | None = None


#: encode(model, call_kwargs) -> Encoded; call_kwargs holds the forward's keyword arguments
Encode = Callable[[Any, Mapping[str, Any]], Encoded]
#: counts(model config, inputs) -> a :func:`count_table` on the inputs' device, torch ops
#: alone (no host read)
Counts = Callable[[Any, Mapping[str, Any]], torch.Tensor]

#: the columns of a count table: runs, placeholders per run, frames, frame height and width
#: (pixels), feature grid (t, h, w); 0 where unknown
COUNT_COLUMNS = ("runs", "tokens", "frames", "height", "width", "grid_t", "grid_h", "grid_w")


def count_table(
    tokens: torch.Tensor,
    runs: torch.Tensor | int = 1,
    *,
    frames: torch.Tensor | int = 0,
    hw: torch.Tensor | tuple[int, int] | None = None,
    grid: torch.Tensor | None = None,
) -> torch.Tensor:
    """A ``counts`` result, int64 ``[n, 8]`` (:data:`COUNT_COLUMNS`) on ``tokens``' device: per
    model-level item (``tokens``: ``[n]``, placeholders per run) its ``runs`` of that length,
    ``frames``, frame size ``hw`` (``[n, 2]`` or one ``(H, W)``) and ``grid`` (``[n, 3]``);
    the sizes only name the item in records."""
    n, dev = tokens.shape[0], tokens.device

    def cols(v, k: int) -> torch.Tensor:
        if v is None:
            return torch.zeros(n, k, dtype=torch.long, device=dev)
        t = torch.as_tensor(v, device=dev).long()
        return t.reshape(-1, k).expand(n, k) if t.numel() <= k else t.reshape(n, k)

    parts = [cols(runs, 1), tokens.long().reshape(n, 1), cols(frames, 1), cols(hw, 2)]
    return torch.cat([*parts, cols(grid, 3)], dim=1)


#: repair encoder for one item: (model, new_pixels [C, H', W']) -> features [n, h]
Reencode = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Merged:
    """What a family's ``after_merge`` sees: the forward's ``kwargs`` after the merge, ``items``
    and ``features`` in token order, and ``runs()`` (read from the ids when asked, once: a
    transfer): per run its item, ``(row, start, end)``, whether its sample was kept, and its
    model-level item."""

    kwargs: Mapping[str, Any]
    items: tuple
    features: tuple
    runs: Callable[[], tuple[tuple[Any, tuple[int, int, int], bool, int], ...]]


#: after_merge(model, merged) -> keyword arguments to replace (Nemotron's EVS pruning)
AfterMerge = Callable[[Any, Merged], Mapping[str, Any]]


@dataclass(frozen=True)
class ModalitySpec:
    """One modality of a family.

    placeholder / start / end: its tokens (``end`` alone: an end marker after each run,
        Pixtral's ``[IMG_END]``). breaks: tokens inside its runs that take no feature
        (Pixtral's ``[IMG_BREAK]``). shares: the modality whose placeholder it reuses.
    inputs: the forward keywords of its media (the first present: the call holds it); set to
        None after the merge except ``keep`` (the grids positions are computed from).
    reencode: how one repaired item is encoded (None: never repaired).
    rows: inputs whose dim-0 rows are its model-level items: a dropped sample's rows leave.
    patches: ``{input: grid input}`` for flat patch rows, ``prod(grid row)`` per item; a
        repaired item's grid row takes the solved (h, w).
    counts: per model-level item its runs (a :func:`count_table`) from the inputs alone (no
        model): what ``check_batch`` checks and ``apply="inputs"`` sizes the items by.
    split: ``"items"``: the inputs do not say which units (InternVL's tiles) make an item;
        ``counts`` gives one row (runs = units), cut by the caller's items, whole units each.
    groups: inputs with one entry per sample holding its item count (LLaVA-OneVision's
        ``batch_num_images``): a dropped sample's entry leaves with its items.
    type_id: its value in :attr:`FamilySpec.token_types`, for a shared placeholder.
    nests: its markers may sit right inside another modality's region (``Grammar.inner``).
    """

    name: ModalityName
    placeholder: Token
    inputs: tuple[str, ...]
    encode: Encode
    start: Token | None = None
    end: Token | None = None
    shares: ModalityName | None = None
    reencode: Reencode | None = None
    keep: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    patches: Mapping[str, str] = field(default_factory=dict)
    counts: Counts | None = None
    split: Literal["items"] | None = None
    groups: tuple[str, ...] = ()
    type_id: int | None = None
    breaks: tuple[Token, ...] = ()
    nests: bool = False


@dataclass(frozen=True)
class FamilySpec:
    """A model family: ``classes`` by defining package prefix (a subclass counts; ``detect``: a
    test beside them), ``modalities`` in the model's order, ``text`` the id a generated or
    dropped placeholder becomes, ``geometry(model)`` the repair geometry (None: no repair).
    ``apply``: ``"embed"`` (the guard merges, passes ``inputs_embeds``), ``"inputs"`` (items
    sized by ``counts``, the plan applied by rewriting the inputs; ``encode`` never called),
    ``"llava"`` / ``"mimo"`` (megatron-core's merge methods, wrapped).

    follow_ids: per-token inputs set 0 where a dropped placeholder becomes ``text``.
    positions(model, kwargs): ``position_ids`` from the model's rope on the rewritten inputs.
    ids_with_embeds False: the forward takes ``input_ids`` or ``inputs_embeds``, not both.
    embed(model, ids): the ``[b, s, h]`` token embeddings (None: ``get_input_embeddings()``).
    reuse(model, encoded, kept): keywords added after the merge from the placed items'
    outputs (Qwen3-Omni's deepstack). dummy(model): the tower on a minimal input
    (``GuardConfig.keep_tower``). token_types: a per-token type input telling the runs of a
    shared placeholder apart (``ModalitySpec.type_id``). drop_markers: a dropped sample's
    markers become ``text`` too (Qwen3-Omni's rope counts audio starts). derive(name, ids,
    grammar): what a ``follow_ids`` input must be for ``ids`` (rebuilt where it disagrees).
    """

    name: str
    classes: Mapping[str, frozenset[str]]
    modalities: tuple[ModalitySpec, ...]
    text: Token = field(default_factory=Token)
    apply: Apply = "embed"
    geometry: Callable[[Any], Any] | None = None
    detect: Callable[[Any], bool] | None = None
    follow_ids: tuple[str, ...] = ()
    positions: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None
    ids_with_embeds: bool = True
    after_merge: AfterMerge | None = None
    embed: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    reuse: Callable[[Any, Mapping[str, Encoded], Mapping[str, list[int]]], dict] | None = None
    token_types: str | None = None
    dummy: Callable[[Any], Any] | None = None
    drop_markers: bool = False
    derive: Callable[[str, torch.Tensor, Grammar], torch.Tensor] | None = None

    def matches(self, model: Any) -> bool:
        if self.detect is not None and self.detect(model):
            return True
        return any(
            cls.__name__ in names and cls.__module__.startswith(prefix)
            for cls in type(model).__mro__
            for prefix, names in self.classes.items()
        )

    def bridge(self, *classes: str, **changes: Any) -> FamilySpec:
        """This spec's Megatron-Bridge copy: its ``classes``, ``input_ids`` beside the embeddings
        of its language model (:func:`bridge_embed`), then ``changes``."""
        changes = {"ids_with_embeds": True, "embed": bridge_embed, **changes}
        return replace(self, classes={"megatron.bridge.": frozenset(classes)}, **changes)

    def grammar(self, model: Any, tokenizer: Any = None, caller: str = "install_vlm") -> Grammar:
        """The guard's grammar from the model's config (else the tokenizer); an error naming
        every token not found and ``caller``, the function to pass the tokenizer to."""
        missing: list[str] = []

        def resolve(tok: Token, what: str) -> int | None:
            tid = tok.resolve(model, tokenizer)
            if tid is None:
                missing.append(f"{what} {_where(tok)}")
            return tid

        placeholders: dict[str, int] = {}
        pairs, inner, end_only, breaks = {}, {}, {}, {}  # ordered sets
        for m in self.modalities:
            tid = None if m.shares else resolve(m.placeholder, f"{m.name} placeholder")
            if tid is not None:
                placeholders[m.name] = tid
            if m.start is not None and m.end is not None:
                a, b = m.start.resolve(model, tokenizer), m.end.resolve(model, tokenizer)
                if a is None or b is None:
                    missing.append(f"{m.name} start/end markers {_where(m.start)}")
                else:
                    pairs[(a, b)] = None
                    if m.nests:
                        inner[(a, b)] = None
            elif m.end is not None and (b := resolve(m.end, f"{m.name} end marker")) is not None:
                end_only[b] = None
            for t in m.breaks:
                if (k := resolve(t, f"{m.name} break token")) is not None:
                    breaks[k] = None
        if missing:
            if tokenizer is None:
                fix = "set them on model.config, or pass tokenizer= (the model's tokenizer"
                fix += " or a {token text: id} mapping)"
            elif isinstance(tokenizer, Mapping):
                fix = "the tokenizer mapping given has none of these tokens: add them to it"
            else:
                fix = (
                    f"the tokenizer given ({type(tokenizer).__name__}) does not know these "
                    "tokens (unknown, or its unk id): pass the model's own tokenizer, or a "
                    "{token text: id} mapping"
                )
            raise MediaInputError(
                f"{caller}: {self.name}: no token id for " + "; ".join(missing) + f" ({fix})",
                context={"family": self.name, "missing": missing},
            )
        if (pairs and end_only) or len(end_only) > 1:
            raise MediaInputError(
                f"{self.name}: one end-only marker, and no marker pairs beside it"
            )
        pairs, ends = list(pairs), list(end_only)
        start, end = pairs[0] if pairs else (None, ends[0] if ends else None)
        text = self.text.resolve(model, tokenizer)
        specials = {*placeholders.values(), *(t for p in pairs for t in p), *ends, *breaks}
        return Grammar(
            placeholders,
            start_id=start,
            end_id=end,
            break_ids=tuple(breaks),
            regions=tuple(pairs[1:]),
            aliases={m.name: m.shares for m in self.modalities if m.shares is not None},
            name=self.name,
            text_id=None if text in specials else text,
            inner=tuple(inner),
        )


def _where(tok: Token) -> str:
    parts = [f"config.{p}" for p in tok.config]
    if tok.text:
        parts.append(f"tokenizer {tok.text!r}")
    return f"({' / '.join(parts) or 'nowhere'})"


def model_encodes(model: Any, kwargs: Mapping[str, Any]) -> Encoded:
    """The ``encode`` of an ``apply="inputs"`` modality, never called."""
    raise MediaInputError("apply='inputs': the model encodes its own media; nothing calls this")


def present(spec: FamilySpec, kwargs: Mapping[str, Any]) -> list[ModalitySpec]:
    """The modalities whose inputs this call carries, in the spec's order."""
    return [m for m in spec.modalities if kwargs.get(m.inputs[0]) is not None]


def cut_counted(block: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Per-item views of an ``Encoded.counts`` block (flat ``[sum(n_i), h]`` or padded
    ``[items, max, h]``) cut by ``sizes``."""
    if block.dim() == 2:
        if sum(sizes) != block.shape[0]:
            raise MediaInputError(
                f"the model produced {block.shape[0]} feature rows for items of {list(sizes)}"
            )
        return tuple(block.split(list(sizes)))
    return tuple(f[:n] for f, n in zip(block, sizes))


def bridge_embed(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """A Megatron-Bridge VL model's ``[b, s, h]`` token embeddings: its language model's own
    ``embedding`` (``[s, b, h]``), transposed."""
    return model.language_model.embedding(input_ids=ids, position_ids=None).transpose(0, 1)


def tower_zeros(model: Any, tower: Any, *shape: int) -> torch.Tensor:
    """Zeros of ``shape`` for a spec's ``dummy``, in the device and dtype of the tower's first
    floating parameter (``tower``: the module, or its attribute name on the model or its
    ``.model``; float32 on the CPU without one)."""
    mod = attr_path(model, tower, f"model.{tower}") if isinstance(tower, str) else tower
    p = next((p for p in mod.parameters() if p.is_floating_point()), None)
    if p is None:
        return torch.zeros(shape)
    return torch.zeros(shape, dtype=p.dtype, device=p.device)
