"""One call's items: in the model's consumption order with the caller's items laid on them,
in token order (typed where the spec's token types decide); beside their count tables
``set_items`` checked against them, an item whose runs lie in two samples (never kept or
repaired), the items no run takes. Shared by both modes of the family engine and
:func:`~.collate.check_batch`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..core.interleave import queued, read_runs, take_per_run, token_order
from ..core.items import MediaItem
from ..core.parsed import Run
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError
from .spec import Encoded, ModalitySpec


def call_items(
    mods: Sequence[ModalitySpec], encoded: dict[str, Encoded], meta: Sequence[MediaItem] | None
) -> tuple[list[MediaItem], list[torch.Tensor], list[int] | None, list[int]]:
    """MediaItems (frames, frame size and grid where ``encoded`` gives them) and features in
    the model's consumption order (modality by modality); when ``meta`` is given (one item
    per model-level item: a video, not its tubelets; the k-th of a modality describes the
    model's k-th), the items' order as listed there (``set_items``: the token order), else
    None; per item its model-level item (numbered per modality)."""
    items: list[MediaItem] = []
    feats: list[torch.Tensor] = []
    parent: list[int] = []
    first: dict[str, list[int]] = {}  # modality -> per model-level item, its first item index
    end: dict[str, int] = {}  # modality -> past its last item
    for m in mods:
        enc = encoded[m.name]
        pieces = item_features(enc)
        parents = enc.parent or tuple(range(len(pieces)))
        parent += parents
        starts = first.setdefault(m.name, [])
        for k, f in enumerate(pieces):
            if parents[k] == len(starts):
                starts.append(len(items))
            items.append(
                MediaItem(
                    int(f.shape[0]),
                    modality=m.name,
                    num_frames=enc.num_frames[k] if enc.num_frames else None,
                    frame_hw=enc.frame_hw[k] if enc.frame_hw else None,
                    pixels=enc.pixels[k] if enc.pixels else None,
                    grid_thw=enc.grid[k] if enc.grid else None,
                )
            )
            feats.append(f)
        end[m.name] = len(items)
    if meta is None:
        return items, feats, None, parent
    want = {m: len(v) for m, v in first.items()}
    got: dict[str, int] = {}
    for g, src in enumerate(meta):
        if src.modality not in want:
            raise MediaInputError(
                f"set_items: item {g} has modality {src.modality!r}; this call holds "
                f"{want} model-level items"
            )
        got[src.modality] = got.get(src.modality, 0) + 1
    if got != {k: n for k, n in want.items() if n}:
        raise MediaInputError(
            f"set_items gave {len(meta)} items {got} for this call's {want} (one per image, "
            "video and audio clip)"
        )
    order: list[int] = []
    rank: dict[str, int] = {}
    for src in meta:
        k = rank.get(src.modality, 0)
        rank[src.modality] = k + 1
        starts = first[src.modality]
        lo, hi = starts[k], starts[k + 1] if k + 1 < len(starts) else end[src.modality]
        for i in range(lo, hi):
            items[i] = replace(
                items[i], sample=src.sample, sample_id=src.sample_id, source_hw=src.source_hw
            )
            order.append(i)
    return items, feats, order, parent


def item_features(enc: Encoded) -> tuple[torch.Tensor, ...]:
    """The items' features; a ``counts`` block's as empty rows (counted with the verdict)."""
    if enc.counts is None:
        return enc.features
    (block,) = enc.features
    return (block.new_zeros((0, block.shape[-1])),) * int(enc.counts.shape[0])


def typed_keys(mods, types) -> torch.Tensor | None:
    """``types`` where they decide the token order (several modalities, one on a shared
    token, ``type_id``s given), else None."""
    typed = any(m.type_id is not None for m in mods) and any(m.shares is not None for m in mods)
    return types if isinstance(types, torch.Tensor) and len(mods) > 1 and typed else None


def typed_runs_order(runs: Sequence[Run], grammar, mods, items: list[MediaItem]):
    """Each run takes the next item of the modality whose ``type_id`` its ``key`` is; None
    where a run is typed as none of them (the length interleaving decides)."""
    code = {m.type_id: m.name for m in mods if m.type_id is not None}
    shared = {grammar.token_modality(m.name) for m in mods if m.shares is not None}
    wants = [code.get(r.key) if r.modality in shared else r.modality for r in runs]
    if None in wants:
        return None
    taken, rest = take_per_run(queued([it.modality for it in items]), wants)
    return [i for i in taken if i >= 0] + rest  # items beyond the runs: reported


def token_items(ids, grammar, mods, encoded, meta=None, types=None, *, listed=True):
    """The call's items (:func:`call_items`, ``meta`` laid on them) in token order, and per
    item its model-level item: the order ``meta`` lists where ``listed``, else each run taking
    the next item of its typed modality where ``types`` decide (:func:`typed_runs_order` on
    the runs read, one transfer), else the length interleaving
    (:func:`~..core.interleave.token_order`)."""
    items, _, order, parent = call_items(mods, encoded, meta)
    if (order is None or not listed) and typed_keys(mods, types) is not None:
        runs = read_runs(TokenLayout(ids, grammar), types)
        order = typed_runs_order(runs, grammar, mods, items) if runs else None
    elif not listed:
        order = None
    if order is None:
        order = token_order(ids, grammar, items, parent)
    return [items[i] for i in order], [parent[i] for i in order]


def in_order(meta: Sequence[MediaItem]) -> bool:
    """Whether each modality's items come in sample order."""
    last: dict[str, int] = {}
    for it in meta:
        if it.sample is not None:
            if it.sample < last.get(it.modality, -1):
                return False
            last[it.modality] = it.sample
    return True


def meta_tables(meta, mods, tables, num_samples: int):
    """``(ok, samples, declared)``: whether the call's ``set_items`` can be checked on the
    device (their host shapes match the tables', samples in order), and then per modality
    each model-level item's sample (None: not given) and declared features."""
    if meta is None:
        return True, None, None
    mine = {m.name: [it for it in meta if it.modality == m.name] for m in mods}
    given = [it.sample is not None for it in meta]
    placed = all(given) and in_order(meta) and all(0 <= it.sample < num_samples for it in meta)
    if (
        sum(map(len, mine.values())) != len(meta)
        or any(len(mine[m.name]) != t.shape[0] for m, t in zip(mods, tables))
        or (any(given) and not placed)
    ):
        return False, None, None

    def on_device(field: str) -> dict[str, torch.Tensor]:
        out = {}
        for m, t in zip(mods, tables):
            values = torch.tensor([getattr(it, field) for it in mine[m.name]], dtype=torch.long)
            out[m.name] = values.to(t.device, non_blocking=True)
        return out

    return True, on_device("sample") if any(given) else None, on_device("num_features")


def check_declared(meta, mods, encoded) -> None:
    """Refuses an item of ``set_items`` whose ``num_features`` is not its inputs' count,
    naming its grid."""
    if meta is None:
        return
    rank: dict[str, int] = {}
    for g, it in enumerate(meta):
        enc = encoded.get(it.modality)
        if enc is None:
            continue
        k = rank.get(it.modality, 0)
        rank[it.modality] = k + 1
        mine = [i for i, p in enumerate(enc.parent) if p == k]
        if not mine:
            continue
        total = sum(int(enc.features[i].shape[0]) for i in mine)
        if it.num_features != total:
            grid = enc.grid[mine[0]] if enc.grid else None
            raise MediaInputError(
                f"item {g} is {it.modality} with {it.num_features} features; {it.modality} "
                f"grid row {k} {grid} gives {total}",
                context={"item": g, "grid_thw": list(grid) if grid else None},
            )


def split_items(lay: TokenLayout, items: list[MediaItem], parent: list[int]):
    """Items (token order) of a model-level item whose runs lie in several samples (a
    Qwen3-VL video's temporal groups) tied to its first run's sample, and per such item why
    (never kept or repaired). Reads the runs only where an item has several (fault path)."""
    keys = [(it.modality, p) for it, p in zip(items, parent)]
    if len(set(keys)) == len(keys):
        return items, {}
    runs = parse_layout(lay).runs  # each item takes the next run of its placeholder token
    tokens = [lay.grammar.token_modality(it.modality) for it in items]
    taken, _ = take_per_run(queued([r.modality for r in runs]), tokens)
    run_sample = [runs[j].sample if j >= 0 else None for j in taken]
    where: dict[tuple, set] = {}
    for key, s in zip(keys, run_sample):
        if s is not None:
            where.setdefault(key, set()).add(s)
    split = {key: smp for key, smp in where.items() if len(smp) > 1}
    why = {k: f"its runs fall in samples {sorted(v)}" for k, v in split.items()}
    if not split or any(it.sample is not None for it in items) or None in run_sample:
        return items, why
    first = {}
    for key, s in zip(keys, run_sample):
        first.setdefault(key, s)
    tied = [
        replace(it, sample=first[key] if key in split else s)
        for it, key, s in zip(items, keys, run_sample)
    ]
    return tied, why


def orphans(report, owner) -> set[tuple[str, int]]:
    """Model-level items of which no run is tied to a sample (they leave the inputs)."""
    rep = report.alignment
    if rep is None:
        return set()
    tied = {i for r in rep.samples for i in r.items}
    used = {owner[i] for i in tied}
    return {o for i, o in enumerate(owner) if i not in tied and o not in used}
