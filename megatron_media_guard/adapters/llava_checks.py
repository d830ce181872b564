"""Per-sample checks for megatron-core's collapsed LLaVA merge (``_preprocess_data``).

In that merge every sample carries one image token (default id -200) per image;
``num_image_tiles`` holds one entry per image, consumed in token order (row-major);
``image_embeddings`` is ``[img_seq_len, sum(num_image_tiles), h]`` (tiles along dim 1,
in the same order); image j expands to ``num_image_tiles[j] * img_seq_len`` positions
and the merged sequence is cut at ``language_max_sequence_length`` afterwards.

:func:`measure` reduces a call to host facts with one device-to-host transfer;
:func:`find_faults` turns the facts (and optional item metadata) into per-sample
faults. Nothing here loops over tokens: loops run over samples and images.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..core.grammar import Grammar
from ..core.host import to_host
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError

Check = Literal["count", "tiles", "max_length", "nonfinite"]


@functools.lru_cache(maxsize=16)
def llava_grammar(image_token_index: int) -> Grammar:
    return Grammar.llava(int(image_token_index))


@dataclass(frozen=True)
class ImageFault:
    """One finding in one sample.

    image: index of the image in ``num_image_tiles`` (None: no entry can be named).
    image_in_sample: its index among the sample's images. expected / got: what the token
    side and the media side say (counts for ``count``, feature rows for ``tiles``,
    positions for ``max_length``).
    """

    sample: int
    check: Check
    image: int | None
    image_in_sample: int | None
    expected: tuple[int, ...]
    got: tuple[int, ...]
    tiles: int | None
    reason: str


@dataclass(frozen=True)
class LlavaFacts:
    """Host-side facts of one ``_preprocess_data`` call.

    tokens: image tokens per sample ``[b]``. entries: ``num_image_tiles`` (or the
    variant's per-image counts). seq_len: each sample's expanded length (token-order
    assignment; meaningful when the totals agree). cross_image / cross_end: per sample,
    the first image (token order) whose expansion ends past the max length, and that end
    (``num_entries`` / -1 when none). finite_cols: per column of ``image_embeddings``,
    whether it is all finite (empty when not checked).
    """

    batch: int
    row_length: int
    image_token_index: int
    img_seq_len: int
    max_len: int
    lengths_known: bool
    tokens: tuple[int, ...]
    entries: tuple[int, ...]
    seq_len: tuple[int, ...]
    cross_image: tuple[int, ...]
    cross_end: tuple[int, ...]
    finite_cols: tuple[bool, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def token_owners(self) -> list[int]:
        """Sample of each image in token order (one per image token)."""
        return [smp for smp, k in enumerate(self.tokens) for _ in range(k)]


def measure(
    input_ids: torch.Tensor,
    image_token_index: int,
    counts: torch.Tensor | None,
    img_seq_len: int,
    max_len: int,
    image_embeddings: torch.Tensor | None,
    *,
    lengths_known: bool = True,
    check_finite: bool = True,
) -> tuple[LlavaFacts, TokenLayout]:
    """Everything the checks need, moved to the host in one transfer.

    input_ids: ``[b, s]``; counts: ``[n]`` per-image tile counts (None: none);
    image_embeddings: ``[img_seq_len, tiles, h]`` or None (not this stage / not checked).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise MediaInputError(f"LLaVA input_ids must be [b, s], got {shape}")
    b, s = input_ids.shape
    dev = input_ids.device
    lay = TokenLayout(input_ids, llava_grammar(image_token_index))
    ph = lay.ph.reshape(b, s)
    tokens = ph.sum(1)
    cnt = (
        torch.as_tensor(counts).to(dev, torch.int64).reshape(-1)
        if counts is not None
        else torch.zeros(0, dtype=torch.int64, device=dev)
    )
    n = cnt.numel()
    img_idx = (torch.cumsum(ph.reshape(-1), 0) - 1).view(b, s)  # image index, token order
    valid = ph & (img_idx < n)
    if n:
        t_tok = cnt.gather(0, img_idx.clamp(0, n - 1).reshape(-1)).view(b, s)
        t_tok = torch.where(valid, t_tok, torch.zeros_like(t_tok))
    else:
        t_tok = torch.zeros(b, s, dtype=torch.int64, device=dev)
    # megatron-core's own expansion: image token -> t * L positions, text -> 1
    lens = torch.where(ph, t_tok * img_seq_len - 1, torch.zeros_like(t_tok)) + 1
    last_slot = torch.cumsum(lens, 1) - 1  # [b, s] last expanded position of each token
    seq_len = last_slot[:, -1] + 1
    big = torch.full_like(last_slot, n)
    if lengths_known:
        cross = valid & (last_slot >= max_len)
        cross_image = torch.where(cross, img_idx, big).amin(1)
        # positions grow along a row: the first crossing image has the smallest end
        first_end = torch.where(cross, last_slot + 1, torch.full_like(last_slot, 2**62)).amin(1)
        cross_end = torch.where(cross.any(1), first_end, torch.full_like(first_end, -1))
    else:
        cross_image = torch.full((b,), n, dtype=torch.int64, device=dev)
        cross_end = torch.full((b,), -1, dtype=torch.int64, device=dev)
    parts = [tokens, cross_image, cross_end, seq_len, cnt]
    if check_finite and image_embeddings is not None and image_embeddings.dim() == 3:
        # one read of the tiles, [tiles] out; an overflowing sum of finite values is only a
        # false alarm, settled exactly by :func:`refine_finite` off the aligned path
        col_sum = image_embeddings.sum(dim=(0, 2), dtype=torch.float32)
        fin = torch.isfinite(col_sum).to(dev, torch.int64)
        parts.append(fin)
    # the one host sync of the aligned path: per-sample counts, per-image tiles, finite flags
    vals = to_host(torch.cat([p.to(torch.int64) for p in parts]), why="LLaVA merge facts")
    v = vals.tolist()
    return (
        LlavaFacts(
            batch=b,
            row_length=s,
            image_token_index=int(image_token_index),
            img_seq_len=int(img_seq_len),
            max_len=int(max_len),
            lengths_known=lengths_known,
            tokens=tuple(v[:b]),
            cross_image=tuple(v[b : 2 * b]),
            cross_end=tuple(v[2 * b : 3 * b]),
            seq_len=tuple(v[3 * b : 4 * b]),
            entries=tuple(v[4 * b : 4 * b + n]),
            finite_cols=tuple(bool(x) for x in v[4 * b + n :]),
        ),
        lay,
    )


def refine_finite(facts: LlavaFacts, image_embeddings: torch.Tensor) -> LlavaFacts:
    """Exact per-column finite flags for the columns the sum flagged (diagnose path)."""
    bad = [c for c, ok in enumerate(facts.finite_cols) if not ok]
    if not bad:
        return facts
    idx = torch.tensor(bad, dtype=torch.long, device=image_embeddings.device)
    exact = torch.isfinite(image_embeddings.index_select(1, idx)).flatten(2).all(2).all(0)
    flags = list(facts.finite_cols)
    for c, ok in zip(bad, to_host(exact, why="which LLaVA tiles hold NaN/Inf").tolist()):
        flags[c] = bool(ok)
    return replace(facts, finite_cols=tuple(flags))


def item_owners(items: Sequence[MediaItem], facts: LlavaFacts) -> list[int]:
    """Sample of each ``num_image_tiles`` entry according to the item metadata."""
    n = facts.num_entries
    if len(items) != n:
        raise MediaInputError(
            f"LLaVA item metadata has {len(items)} items for {n} num_image_tiles entries "
            "(give one MediaItem per image, in num_image_tiles order)",
            context={"items": len(items), "entries": n},
        )
    owners: list[int] = []
    for j, it in enumerate(items):
        if it.sample is None:
            raise MediaInputError(f"LLaVA item {j} has no sample index (MediaItem.sample)")
        if it.sample >= facts.batch:
            raise MediaInputError(
                f"LLaVA item {j} names sample {it.sample}, the batch has {facts.batch} samples"
            )
        if owners and it.sample < owners[-1]:
            raise MediaInputError(
                f"LLaVA items must come in sample order (megatron-core consumes "
                f"num_image_tiles in token order): item {j} names sample {it.sample} "
                f"after sample {owners[-1]}"
            )
        owners.append(it.sample)
    return owners


def _count_faults(
    facts: LlavaFacts, owners: list[int] | None, items: Sequence[MediaItem] | None
) -> list[ImageFault]:
    out: list[ImageFault] = []
    K, n = facts.total_tokens, facts.num_entries
    if owners is None:  # totals disagree and no metadata says which sample is short
        for smp, k in enumerate(facts.tokens):
            if k:
                out.append(
                    ImageFault(
                        smp,
                        "count",
                        None,
                        None,
                        (k,),
                        (),
                        None,
                        f"the batch holds {K} image tokens for {n} num_image_tiles entries; "
                        "without item metadata the entries cannot be assigned to samples",
                    )
                )
        return out
    per: dict[int, list[int]] = {}
    for j, smp in enumerate(owners):
        per.setdefault(smp, []).append(j)
    for smp in range(facts.batch):
        k, js = facts.tokens[smp], per.get(smp, [])
        if k != len(js):
            out.append(
                ImageFault(
                    smp,
                    "count",
                    js[k] if k < len(js) else None,
                    min(k, len(js)),
                    (k,),
                    (len(js),),
                    None,
                    f"sample holds {k} image tokens, its items {len(js)} num_image_tiles entries",
                )
            )
    if items is not None and facts.lengths_known:
        L = facts.img_seq_len
        for j, (it, t) in enumerate(zip(items, facts.entries)):
            if it.num_features != t * L:
                out.append(
                    ImageFault(
                        it.sample,  # type: ignore[arg-type]
                        "tiles",
                        j,
                        per[it.sample].index(j),  # type: ignore[index]
                        (t * L,),
                        (it.num_features,),
                        t,
                        f"num_image_tiles gives {t} tiles x img_seq_len {L} = {t * L} features, "
                        f"the item metadata {it.num_features}",
                    )
                )
    return out


def _cross_fault(
    smp: int, j: int, i: int, t: int, end: int, facts: LlavaFacts, seq_len: int
) -> ImageFault:
    L, m = facts.img_seq_len, facts.max_len
    start = end - t * L
    return ImageFault(
        smp,
        "max_length",
        j,
        i,
        (t * L,),
        (max(0, m - start),),
        t,
        f"image expands to positions [{start}, {end}) of {seq_len}, past "
        f"language_max_sequence_length {m}: megatron-core would cut it after the merge",
    )


def _length_faults(
    facts: LlavaFacts,
    owners: list[int] | None,
    consistent: bool,
    lay: TokenLayout,
    skip: set[int],
) -> list[ImageFault]:
    if not facts.lengths_known or owners is None:
        return []
    out: list[ImageFault] = []
    starts = {smp: 0 for smp in range(facts.batch)}
    k = 0
    for smp, cnt in enumerate(facts.tokens):
        starts[smp] = k
        k += cnt
    if consistent:
        for smp in range(facts.batch):
            j = facts.cross_image[smp]
            if j < facts.num_entries and smp not in skip:
                out.append(
                    _cross_fault(
                        smp,
                        j,
                        j - starts[smp],
                        facts.entries[j],
                        facts.cross_end[smp],
                        facts,
                        facts.seq_len[smp],
                    )
                )
        return out
    # items disagree with token order: recompute per consistent sample from run positions
    runs = parse_layout(lay).runs  # one transfer sized by the number of images
    pos: dict[int, list[int]] = {}
    for r in runs:
        pos.setdefault(r.sample, []).append(r.start)
    mine: dict[int, list[int]] = {}
    for j, smp in enumerate(owners):
        mine.setdefault(smp, []).append(j)
    L, m = facts.img_seq_len, facts.max_len
    for smp, js in mine.items():
        ps = pos.get(smp, [])
        if smp in skip or len(ps) != len(js):
            continue
        shift = 0
        total = facts.row_length + sum(facts.entries[j] * L - 1 for j in js)
        for i, (p, j) in enumerate(zip(ps, js)):
            t = facts.entries[j]
            end = p + shift + t * L
            if end > m:
                out.append(_cross_fault(smp, j, i, t, end, facts, total))
                break
            shift += t * L - 1
    return out


def find_faults(
    facts: LlavaFacts,
    lay: TokenLayout,
    items: Sequence[MediaItem] | None,
) -> tuple[list[ImageFault], list[int] | None, bool]:
    """``(faults, owners, consistent)``.

    owners: the sample of each entry (from items, else token order when the totals agree,
    else None). consistent: every sample owns as many entries as it holds tokens, so the
    token-order assignment megatron-core uses is the right one.
    """
    owners: list[int] | None
    if items is not None:
        owners = item_owners(items, facts)
    elif facts.total_tokens == facts.num_entries:
        owners = facts.token_owners()
    else:
        owners = None
    consistent = owners is not None and owners == facts.token_owners()
    faults = _count_faults(facts, owners, items)
    bad_count = {f.sample for f in faults if f.check == "count"}
    faults += _length_faults(facts, owners, consistent, lay, bad_count)
    return faults, owners, consistent


def column_ranges(entries: Sequence[int]) -> list[tuple[int, int]]:
    """Columns of ``image_embeddings`` (dim 1) holding each entry's tiles."""
    out, c = [], 0
    for t in entries:
        out.append((c, c + t))
        c += t
    return out


def nonfinite_faults(
    facts: LlavaFacts, owners: list[int] | None, entries_per_col: bool
) -> list[ImageFault]:
    """Images whose tiles hold NaN/Inf (needs the per-column flags and known owners)."""
    if not facts.finite_cols or owners is None or not entries_per_col:
        return []
    out: list[ImageFault] = []
    seen: set[int] = set()
    per_sample_index: dict[int, int] = {}
    for j, (a, b) in enumerate(column_ranges(facts.entries)):
        smp = owners[j]
        i = per_sample_index.get(smp, 0)
        per_sample_index[smp] = i + 1
        if smp in seen or all(facts.finite_cols[a:b]):
            continue
        seen.add(smp)
        out.append(
            ImageFault(
                smp,
                "nonfinite",
                j,
                i,
                (facts.entries[j],),
                (sum(1 for c in facts.finite_cols[a:b] if not c),),
                facts.entries[j],
                "NaN/Inf in the image's tile embeddings (got: tiles affected)",
            )
        )
    return out
