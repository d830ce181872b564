"""Findings of one LLaVA ``_preprocess_data`` call from its host facts: the images' and the
packed sub-samples' faults per sample (the sound's: :mod:`.sound`) and the arguments' shapes
(batch level). Loops run over samples and images, never tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...core.alignment import by_key
from ...core.faults import ItemFault
from ...core.generated import Generated, as_text, find_generated
from ...core.items import MediaItem
from ...core.runs import TokenLayout, parse_layout
from ...errors import MediaInputError
from .measure import LlavaFacts
from .packed import PAD_TOKEN, llava_grammar

SOUND_MODALITIES = frozenset({"sound", "audio"})


@dataclass(frozen=True)
class ImageOwners:
    """Sample of each ``num_image_tiles`` entry (None: cannot be assigned); ``consistent``:
    that is megatron-core's own token-order assignment."""

    owners: tuple[int, ...] | None
    consistent: bool

    def of(self, sample: int) -> list[int]:
        return [] if self.owners is None else [j for j, o in enumerate(self.owners) if o == sample]


def split_items(items: Sequence[MediaItem] | None) -> tuple[list | None, list | None]:
    """(image items, sound items); each None when the metadata holds none of that kind."""
    snd = [it for it in items or () if it.modality in SOUND_MODALITIES]
    img = [it for it in items or () if it.modality not in SOUND_MODALITIES]
    return (img or None), (snd or None)


def item_owners(items: Sequence[MediaItem], count: int, batch: int, what: str) -> list[int]:
    """Sample of each item according to the metadata (one item per entry / clip)."""
    if len(items) != count:
        raise MediaInputError(
            f"LLaVA item metadata has {len(items)} {what} items for {count} {what} entries "
            f"(give one MediaItem per {what}, in the order megatron-core consumes them)",
            context={"items": len(items), "entries": count},
        )
    owners: list[int] = []
    for j, it in enumerate(items):
        if it.sample is None:
            raise MediaInputError(f"LLaVA {what} item {j} has no sample index (MediaItem.sample)")
        if it.sample >= batch:
            raise MediaInputError(
                f"LLaVA {what} item {j} names sample {it.sample}, the batch has {batch} samples"
            )
        if owners and it.sample < owners[-1]:
            raise MediaInputError(
                f"LLaVA {what} items must come in sample order (megatron-core consumes them in "
                f"token order): item {j} names sample {it.sample} after sample {owners[-1]}"
            )
        owners.append(it.sample)
    return owners


def _packed_owners(facts: LlavaFacts) -> list[int] | None:
    """Entries of a packed row whose totals disagree: the sub-samples before the unmatched
    ones take theirs from the front, those after from the back, the first unmatched the rest."""
    bad = [i for i, sp in enumerate(facts.spans) if not sp.resolved]
    if not bad:
        return None
    lo, hi = bad[0], bad[-1]
    front = [smp for smp in range(lo) for _ in range(facts.tokens[smp])]
    back = [smp for smp in range(hi + 1, facts.batch) for _ in range(facts.tokens[smp])]
    middle = facts.num_entries - len(front) - len(back)
    if middle < 0:
        return None
    return front + [lo] * middle + back


def image_owners(facts: LlavaFacts, items: Sequence[MediaItem] | None) -> ImageOwners:
    if items is not None:
        owners = item_owners(items, facts.num_entries, facts.batch, "image")
    elif facts.total_tokens == facts.num_entries:
        owners = facts.token_owners()
    elif facts.packed:
        owners = _packed_owners(facts)
    else:
        owners = None
    consistent = owners is not None and owners == facts.token_owners()
    return ImageOwners(None if owners is None else tuple(owners), consistent)


def _segment_faults(facts: LlavaFacts) -> list[ItemFault]:
    why = (
        "packed sub-sample [{}, {}) of cu_seqlens is not filled by the expansion of its tokens "
        "(an image token or an image's token count differs from what the packing assumed)"
    )
    return [
        ItemFault(
            smp,
            "segment",
            "sample",
            why.format(sp.merged_start, sp.merged_end),
            expected=(sp.merged_end - sp.merged_start,),
        )
        for smp, sp in enumerate(facts.spans)
        if not sp.resolved
    ]


def _count_faults(
    facts: LlavaFacts, own: ImageOwners, items: Sequence[MediaItem] | None
) -> list[ItemFault]:
    if own.owners is None:  # totals disagree and nothing says which sample is short
        why = (
            f"the batch holds {facts.total_tokens} image tokens for {facts.num_entries} "
            "num_image_tiles entries; without item metadata the entries cannot be assigned "
            "to samples"
        )
        return [
            ItemFault(s, "count", "image", why, expected=(k,))
            for s, k in enumerate(facts.tokens)
            if k
        ]
    out: list[ItemFault] = []
    for smp in range(facts.batch):
        k, js = facts.tokens[smp], own.of(smp)
        if k != len(js):
            out.append(
                ItemFault(
                    smp,
                    "count",
                    "image",
                    f"sample holds {k} image tokens, its items {len(js)} num_image_tiles entries",
                    item=js[k] if k < len(js) else None,
                    item_in_sample=min(k, len(js)),
                    expected=(k,),
                    got=(len(js),),
                )
            )
    if items is not None:
        L = facts.img_seq_len
        for j, (it, t) in enumerate(zip(items, facts.entries)):
            if it.num_features != t * L:
                out.append(
                    ItemFault(
                        it.sample,
                        "tiles",
                        "image",
                        f"num_image_tiles gives {t} x img_seq_len {L} = {t * L} feature rows, "
                        f"the item metadata {it.num_features}",
                        item=j,
                        item_in_sample=own.of(it.sample).index(j),
                        expected=(t * L,),
                        got=(it.num_features,),
                        tiles=t,
                    )
                )
    return out


def _cross_fault(smp, j, i, facts: LlavaFacts, end, seq_len=None) -> ItemFault:
    """Image ``j`` (the ``i``-th of sample ``smp``) ends at ``end``, past the max length;
    ``seq_len``: the sample's expanded length (default: its span's end)."""
    L, m, t = facts.img_seq_len, facts.max_len, facts.entries[j]
    start = end - t * L
    seq_len = facts.spans[smp].merged_end if seq_len is None else seq_len
    return ItemFault(
        smp,
        "max_length",
        "image",
        f"image expands to positions [{start}, {end}) of {seq_len}, past "
        f"language_max_sequence_length {m}: megatron-core would cut it after the merge",
        item=j,
        item_in_sample=i,
        expected=(t * L,),
        got=(max(0, m - start),),
        tiles=t,
    )


def _length_faults(facts: LlavaFacts, own: ImageOwners, ids, skip: set[int]) -> list[ItemFault]:
    if own.owners is None:
        return []
    if own.consistent:
        return [
            _cross_fault(smp, j, own.of(smp).index(j), facts, facts.cross_end[smp])
            for smp, j in enumerate(facts.cross_image)
            if j < facts.num_entries and smp not in skip
        ]
    if facts.packed:  # positions after an unmatched sub-sample are not known
        return []
    # items disagree with token order: recompute per consistent sample from run positions
    lay = TokenLayout(ids, llava_grammar(facts.image_token_index))
    runs = parse_layout(lay).runs  # one transfer sized by the number of images
    pos = by_key((r.sample, r.start) for r in runs)
    L, m = facts.img_seq_len, facts.max_len
    out: list[ItemFault] = []
    for smp in range(facts.batch):
        js, ps = own.of(smp), pos.get(smp, [])
        if smp in skip or len(ps) != len(js):
            continue
        shift = 0
        total = facts.row_length + sum(facts.entries[j] * L - 1 for j in js)
        for i, (p, j) in enumerate(zip(ps, js)):
            t = facts.entries[j]
            end = p + shift + t * L
            if end > m:
                out.append(_cross_fault(smp, j, i, facts, end, total))
                break
            shift += t * L - 1
    return out


def nonfinite_fault(smp, modality, mine, bad, sizes, reason) -> list[ItemFault]:
    """The fault of sample ``smp`` at its first item of ``mine`` holding NaN/Inf (``bad``: the
    units affected per item, ``sizes``: its units), or none."""
    i = next((i for i, j in enumerate(mine) if bad[j]), None)
    if i is None:
        return []
    j = mine[i]
    return [
        ItemFault(
            smp,
            "nonfinite",
            modality,
            reason,
            item=j,
            item_in_sample=i,
            expected=(sizes[j],),
            got=(bad[j],),
            tiles=sizes[j] if modality == "image" else None,
        )
    ]


def image_faults(
    facts: LlavaFacts, items: Sequence[MediaItem] | None, ids
) -> tuple[list[ItemFault], ImageOwners]:
    """``(faults, owners)`` for the images and the packed sub-samples."""
    own = image_owners(facts, items)
    faults = _segment_faults(facts) + _count_faults(facts, own, items)
    skip = {f.sample for f in faults}
    faults += _length_faults(facts, own, ids, skip)
    if facts.entry_bad and own.owners is not None:
        why = "NaN/Inf in the image's embeddings (got: tiles / rows affected)"
        for smp in range(facts.batch):
            faults += nonfinite_fault(
                smp, "image", own.of(smp), facts.entry_bad, facts.entries, why
            )
    return faults, own


def generated_as_text(a: dict, ignore_index: int) -> Generated | None:
    """Image tokens the policy generated, made token 0 in ``a["input_ids"]``: those under the
    loss mask (a collapsed grammar has no regions; megatron-core's labels are never
    ``ignore_index``). None without a loss mask or when there is none. Positions are per
    row: :func:`per_sample` names the samples."""
    lm, ids = a.get("loss_mask"), a["input_ids"]
    if not isinstance(lm, torch.Tensor) or lm.shape != ids.shape:
        return None
    grammar = llava_grammar(int(a["image_token_index"]))
    gen = find_generated(TokenLayout(ids, grammar), None, lm, ignore_index)
    if gen is not None:
        a["input_ids"] = as_text(ids, gen, PAD_TOKEN, None, grammar)[0]
    return gen


def per_sample(gen: Generated, spans) -> Generated:
    """``gen`` with its positions grouped by the call's samples (rows, or packed ``spans``)."""

    def sample_of(row: int, col: int, default: int) -> int:
        at = (k for k, sp in enumerate(spans) if sp.row == row and sp.start <= col < sp.end)
        return next(at, default)

    hits = [(g.row, c, sample_of(g.row, c, g.sample)) for g in gen.samples for c in g.positions]
    return Generated.grouped(gen.mask, hits)


def generated_faults(gen: Generated, action: str) -> list[ItemFault]:
    """One ``generated`` fault per sample, none under ``"text"`` (fed as text, kept)."""
    if action == "text":
        return []
    why = gen.reasons(action)
    return [
        ItemFault(g.sample, "generated", "image", why[g.sample], expected=g.positions)
        for g in gen.samples
    ]


def _image_problem(a: dict[str, Any], facts: LlavaFacts) -> str | None:
    emb = a.get("image_embeddings")
    lang = a.get("language_embeddings")
    L, T = facts.img_seq_len, sum(facts.entries)
    packed = bool(a.get("is_packed_dynamic_res"))
    want = f"[{T} (sum of num_image_tiles), 1, h]" if packed else f"[{L}, {T}, h]"
    if not isinstance(emb, torch.Tensor) or emb.dim() != 3:
        shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        return f"image_embeddings must be {want}, got {shape}"
    if (emb.shape[0], emb.shape[1]) != ((T, 1) if packed else (L, T)):
        layout = "is_packed_dynamic_res" if packed else "img_seq_len x tiles"
        return f"image_embeddings is {tuple(emb.shape)}, expected {want} ({layout})"
    if isinstance(lang, torch.Tensor) and emb.shape[2] != lang.shape[-1]:
        return f"image_embeddings hidden size {emb.shape[2]} != language hidden {lang.shape[-1]}"
    return None


def _sound_problem(a: dict[str, Any], facts: LlavaFacts) -> str | None:
    snd, lang = a.get("sound_embeddings"), a.get("language_embeddings")
    if snd.dim() != 3:
        return f"sound_embeddings must be [rows, clips, h], got {tuple(snd.shape)}"
    T, C = snd.shape[0], snd.shape[1]
    if C and a.get("sound_embeddings_len") is None and not facts.sound_padded:
        return f"sound_embeddings has {C} clips and no sound_embeddings_len"
    if len(facts.clip_rows) != C:
        return f"sound_embeddings has {C} clips, sound_embeddings_len {len(facts.clip_rows)}"
    if facts.clip_rows and max(facts.clip_rows) > T:
        return f"sound_embeddings_len {list(facts.clip_rows)} exceeds the {T} rows per clip"
    if C and isinstance(lang, torch.Tensor) and snd.shape[2] != lang.shape[-1]:
        return f"sound_embeddings hidden size {snd.shape[2]} != language hidden {lang.shape[-1]}"
    return None


def layout_problems(
    a: dict[str, Any], model: Any, facts: LlavaFacts
) -> tuple[list[str], bool, bool]:
    """``(batch-level problems, image embeddings usable, sound embeddings usable)``, checked on
    the first stage. A wrong layout names no sample (rows are concatenated): always fatal."""
    # a stage without the encoders passes its encoder_hidden_state and no lengths: megatron-core
    # only reads it at sound tokens
    used = any(facts.sound) or a.get("sound_embeddings_len") is not None
    sound = (
        isinstance(a.get("sound_embeddings"), torch.Tensor) and facts.sound_token_index is not None
    )
    img_checked = bool(model.pre_process and facts.num_entries)
    snd_checked = bool(model.pre_process and used and sound)
    img = _image_problem(a, facts) if img_checked else None
    snd = _sound_problem(a, facts) if snd_checked else None
    problems = [f"layout: {p}" for p in (img, snd) if p]
    return problems, img_checked and img is None, snd_checked and snd is None
