"""The ``inputs`` mode's items beside their count tables: ``set_items`` checked against them,
an item whose runs lie in two samples (never kept or repaired), the items no run takes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..core.interleave import queued, take_per_run
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError


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
