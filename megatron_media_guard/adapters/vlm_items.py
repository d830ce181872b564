"""Which feature goes to which run, for one call of the family engine (``adapters/vlm.py``):
the items of the call in the model's consumption order, the caller's ``set_items`` metadata
laid on them, and their permutation into token order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..core.guard import MediaGuard
from ..core.host import to_host
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..diagnostics import GuardRecord
from ..errors import MediaInputError
from ..families.spec import Encoded, ModalitySpec


def cut_blocks(
    mods: Sequence[ModalitySpec],
    encoded: dict[str, Encoded],
    meta: Sequence[MediaItem] | None,
    ids: torch.Tensor,
    guard: MediaGuard,
    step: int | None,
    microbatch: int | None,
) -> dict[str, Encoded]:
    """``encoded`` with every ``split="items"`` block cut into items: by the ``num_features``
    of the call's ``set_items`` for that modality, else by the lengths of that modality's runs
    in token order (a transfer sized by the runs), the last cut taking what is left so that a
    wrong total still shows as that item's mismatch."""
    out = dict(encoded)
    for m in mods:
        enc = encoded[m.name]
        if enc.split != "items":
            continue
        (block,) = enc.features
        rows = int(block.shape[0])
        given = [it for it in meta or () if it.modality == m.name]
        if given:
            sizes = [it.num_features for it in given]
            if sum(sizes) != rows:
                raise MediaInputError(
                    f"set_items declares {sum(sizes)} {m.name} features in all ({sizes}), the "
                    f"model produced {rows}"
                )
        else:
            tok = guard.grammar.token_modality(m.name)
            parsed = parse_layout(TokenLayout(ids, guard.grammar))
            sizes = [r.length for r in parsed.runs if r.modality == tok]
            if sizes:
                sizes[-1] = max(0, rows - sum(sizes[:-1]))
            cut = sum(sizes)
            if cut < rows:  # more features than runs can take: one surplus item
                sizes.append(rows - cut)
            guard.log.emit(
                GuardRecord(
                    event="check",
                    step=step,
                    microbatch=microbatch,
                    modality=m.name,
                    action="runs",
                    reason=f"{m.name} items' feature counts not given (set_items): cut by the "
                    "runs in the ids; only the total was checked",
                )
            )
        pieces = tuple(block.split(sizes)) if sizes else ()
        out[m.name] = replace(enc, features=pieces, split=None)
    return out


def call_items(
    mods: Sequence[ModalitySpec], encoded: dict[str, Encoded], meta: Sequence[MediaItem] | None
) -> tuple[list[MediaItem], list[torch.Tensor], list[int] | None]:
    """MediaItems and features in the model's consumption order (modality by modality), and,
    when ``set_items`` gave metadata, the items' order as listed there (taken as token order).

    ``meta``: one item per model-level item (a video, not its tubelets); the k-th item of a
    modality in the list describes the model's k-th item of that modality.
    """
    items: list[MediaItem] = []
    feats: list[torch.Tensor] = []
    first: dict[str, list[int]] = {}  # modality -> per model-level item, its first item index
    for m in mods:
        enc = encoded[m.name]
        parents = enc.parent or tuple(range(len(enc.features)))
        starts = first.setdefault(m.name, [])
        for k, f in enumerate(enc.features):
            if parents[k] == len(starts):
                starts.append(len(items))
            items.append(
                MediaItem(
                    int(f.shape[0]),
                    modality=m.name,
                    num_frames=enc.num_frames[k] if enc.num_frames else None,
                    frame_hw=enc.frame_hw[k] if enc.frame_hw else None,
                    pixels=enc.pixels[k] if enc.pixels else None,
                    sample=enc.sample[k] if enc.sample and meta is None else None,
                )
            )
            feats.append(f)
    if meta is None:
        return items, feats, None
    want = {m: len(v) for m, v in first.items()}
    got: dict[str, int] = {}
    for g, src in enumerate(meta):
        if src.modality not in want:
            raise MediaInputError(
                f"set_items: item {g} has modality {src.modality!r}; this call holds "
                f"{ {m: n for m, n in want.items()} } model-level items"
            )
        got[src.modality] = got.get(src.modality, 0) + 1
    if got != want:
        raise MediaInputError(
            f"set_items gave {len(meta)} items {got} for this call's {want} (one per image, "
            "video and audio clip)"
        )
    order: list[int] = []
    rank: dict[str, int] = {}
    for src in meta:
        k = rank.get(src.modality, 0)
        rank[src.modality] = k + 1
        lo = first[src.modality][k]
        nxt = first[src.modality][k + 1] if k + 1 < len(first[src.modality]) else None
        hi = nxt if nxt is not None else _end_of(items, lo, src.modality)
        for i in range(lo, hi):
            items[i] = replace(
                items[i], sample=src.sample, sample_id=src.sample_id, source_hw=src.source_hw
            )
            order.append(i)
    return items, feats, order


def parents(mods: Sequence[ModalitySpec], encoded: dict[str, Encoded]) -> list[int]:
    """Per item (consumption order), the model-level item it belongs to (a video's tubelets
    share one), numbered per modality."""
    out: list[int] = []
    for m in mods:
        enc = encoded[m.name]
        out += list(enc.parent or range(len(enc.features)))
    return out


def _end_of(items: list[MediaItem], lo: int, modality: str) -> int:
    hi = lo
    while hi < len(items) and items[hi].modality == modality:
        hi += 1
    return hi


def typed_order(ids, grammar, mods, items: list[MediaItem], types) -> list[int] | None:
    """The items' permutation into token order where modalities share a placeholder token and
    the family has a per-token type (``FamilySpec.token_types``, e.g. ``mm_token_type_ids``):
    each run takes the next item of the modality whose ``type_id`` its first token carries
    (a transfer sized by the runs; mixed batches only). None where that cannot decide (no
    types, no shared token, a run typed as none of them): the length interleaving decides."""
    code = {m.type_id: m.name for m in mods if m.type_id is not None}
    shared = {grammar.token_modality(m.name) for m in mods if m.shares is not None}
    if not isinstance(types, torch.Tensor) or len(mods) < 2 or not shared or not code:
        return None
    parsed = parse_layout(TokenLayout(ids, grammar))
    if not parsed.runs:
        return None
    at = torch.tensor([[r.row, r.start] for r in parsed.runs], device=types.device)
    got = to_host(types[at[:, 0], at[:, 1]], why="token types of runs on a shared token")
    left: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        left.setdefault(it.modality, []).append(i)
    order: list[int] = []
    for r, c in zip(parsed.runs, got.tolist(), strict=True):
        mod = code.get(int(c)) if r.modality in shared else r.modality
        if mod is None:
            return None
        if left.get(mod):
            order.append(left[mod].pop(0))
    return order + [i for v in left.values() for i in v]  # items beyond the runs: reported
