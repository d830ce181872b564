"""Which feature goes to which run, for one call of the family engine (``adapters/vlm.py``):
the items of the call in the model's consumption order, the caller's ``set_items`` metadata
laid on them, and their permutation into token order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..core.guard import MediaGuard
from ..core.host import to_host
from ..core.interleave import interleave
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError
from ..families.spec import Encoded, ModalitySpec


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


def _by_type(parsed, tok: str, by_mod: dict[str, list[int]], mods, types) -> list[int] | None:
    """Items of the runs of token ``tok`` in token order, each run taking the next item of
    the modality whose ``type_id`` its first token carries in ``types``; None when there are
    no types or a run's type names none of ``by_mod``'s modalities."""
    code = {m.type_id: m.name for m in mods if m.name in by_mod and m.type_id is not None}
    runs = [r for r in parsed.runs if r.modality == tok]
    if not isinstance(types, torch.Tensor) or len(code) != len(by_mod) or not runs:
        return None
    at = torch.tensor([[r.row, r.start] for r in runs], device=types.device)
    got = to_host(types[at[:, 0], at[:, 1]], why="token types of runs that share a token")
    if any(int(c) not in code for c in got.tolist()):
        return None
    left = {m: list(v) for m, v in by_mod.items()}
    out = [left[code[int(c)]].pop(0) for c in got.tolist() if left[code[int(c)]]]
    return out + [i for v in left.values() for i in v]  # items beyond the runs: reported


def _end_of(items: list[MediaItem], lo: int, modality: str) -> int:
    hi = lo
    while hi < len(items) and items[hi].modality == modality:
        hi += 1
    return hi


def token_order(
    ids, guard: MediaGuard, mods, items: list[MediaItem], parent: list[int], types=None
) -> list[int]:
    """The items' permutation into token order. One modality: as consumed. Several: the runs'
    order read from the ids (a transfer sized by the runs; mixed batches only); a run whose
    token several modalities share takes the next item of the modality its per-token type
    says (``types``: ``[b, s]``, the spec's ``token_types``; one more transfer sized by those
    runs), else the item the length interleaving gives it (when only one interleaving fits;
    else :class:`MediaInputError` asks for ``set_items``)."""
    if len(mods) == 1:
        return list(range(len(items)))
    g = guard.grammar
    parsed = parse_layout(TokenLayout(ids, g))
    streams: dict[str, dict[str, list[int]]] = {}  # token modality -> modality -> item indices
    for i, it in enumerate(items):
        tok = g.token_modality(it.modality)
        streams.setdefault(tok, {}).setdefault(it.modality, []).append(i)
    runs_of: dict[str, list[int]] = {}
    samples_of: dict[str, list[int]] = {}
    for r in parsed.runs:
        runs_of.setdefault(r.modality, []).append(r.length)
        samples_of.setdefault(r.modality, []).append(r.sample)
    queue: dict[str, list[int]] = {}
    for tok, by_mod in streams.items():
        seqs = list(by_mod.values())
        if len(seqs) == 1:
            queue[tok] = seqs[0]
            continue
        if len(seqs) > 2:
            raise MediaInputError(f"more than two modalities share the {tok!r} token")
        by_type = _by_type(parsed, tok, by_mod, mods, types)
        if by_type is not None:
            queue[tok] = by_type
            continue
        a, b = seqs
        la = [items[i].num_features for i in a]
        lb = [items[i].num_features for i in b]
        pick, unique = interleave(
            runs_of.get(tok, []),
            la,
            lb,
            groups=[parent[i] for i in b],
            run_samples=samples_of.get(tok, []),
        )
        if pick is None:  # no interleaving fits: consumption order, the guard reports it
            queue[tok] = a + b
            continue
        if not unique:  # equal lengths at a choice: the ids cannot tell, and a guess is silent
            raise MediaInputError(
                f"{' and '.join(by_mod)} runs share the {tok!r} token and have equal lengths "
                "where their order is open: the ids cannot tell which is which. Give "
                "handle.set_items(...) with one MediaItem per item in token order"
            )
        ia, ib = iter(a), iter(b)
        queue[tok] = [next(ia) if s == 0 else next(ib) for s in pick]
    order: list[int] = []
    for r in parsed.runs:
        q = queue.get(r.modality)
        if q:
            order.append(q.pop(0))
    order += [i for q in queue.values() for i in q]  # items beyond the runs: the guard reports
    return order
