"""Which feature goes to which run in one call of the family engine: a ``split`` block cut
into items, the counts and runs a tower gives on the device for the verdict's run order (the
call's items and their token order: :mod:`~..families.inputs_items`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..core.grammar import Grammar
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError
from ..families.inputs_items import item_features
from ..families.spec import Encoded, ModalitySpec, cut_counted


def cut_blocks(
    mods: Sequence[ModalitySpec],
    encoded: dict[str, Encoded],
    meta: Sequence[MediaItem] | None,
    ids: torch.Tensor,
    grammar: Grammar,
    note: Callable[[str, str, str], None],
) -> dict[str, Encoded]:
    """``encoded`` with every ``split="items"`` block cut into items: by the ``num_features``
    of the call's ``set_items`` for that modality, else by the lengths of that modality's runs
    in token order (a transfer sized by the runs; ``note(action, reason, modality)`` records
    it), the last cut taking what is left so that a wrong total still shows as that item's
    mismatch."""
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
            tok = grammar.token_modality(m.name)
            parsed = parse_layout(TokenLayout(ids, grammar))
            sizes = [r.length for r in parsed.runs if r.modality == tok]
            if sizes:
                sizes[-1] = max(0, rows - sum(sizes[:-1]))
            cut = sum(sizes)
            if cut < rows:  # more features than runs can take: one surplus item
                sizes.append(rows - cut)
            why = f"{m.name} items' feature counts not given (set_items): cut by the runs in "
            note("runs", why + "the ids; only the total was checked", m.name)
        pieces = tuple(block.split(sizes)) if sizes else ()
        out[m.name] = replace(enc, features=pieces, split=None)
    return out


def counted(
    mods: Sequence[ModalitySpec],
    encoded: dict[str, Encoded],
    items: list[MediaItem],
    parent: list[int],
):
    """Where a modality's counts or runs are on the device (``Encoded.counts`` / ``runs``):
    ``(counts, runs, resize, probe, samples)`` for :class:`~..core.interleave.RunOrder`
    (``resize`` also returns the items' parents and the item each piece came from; ``probe``:
    the padded blocks' rows past their items' counts zeroed, or None; ``samples``: the items'
    ``Encoded.sample``, or None), else None."""
    encs = [encoded[m.name] for m in mods]
    on_dev = [t for e in encs for t in (e.counts, e.runs) if t is not None]
    if not on_dev:
        return None
    dev = on_dev[0].device
    parts, probe = [], []
    for m in mods:
        enc = encoded[m.name]
        if enc.counts is None:
            known = torch.tensor([int(f.shape[0]) for f in enc.features])
            parts.append(known.to(dev, non_blocking=True))  # host to device: no sync
            continue
        parts.append(enc.counts.to(dev).long())
        (block,) = enc.features
        if block.dim() == 3:  # the padding's rows hold no item: out of the check
            valid = torch.arange(block.shape[1], device=block.device) < enc.counts[:, None]
            block = torch.where(valid[..., None], block, 0)
        probe.append(block.reshape(-1))
    lengths = [e.runs.shape[1] for e in encs if e.runs is not None and e.runs.dim() == 2]
    runs, width = None, max(lengths, default=0)  # width: the runs are each run's length
    if any(e.runs is not None for e in encs):  # one run each where not given (of its count)
        one = [F.pad(n[:, None], (0, width - 1)) if width else torch.ones_like(n) for n in parts]
        runs = torch.cat(
            [o if e.runs is None else e.runs.to(dev).long() for e, o in zip(encs, one)]
        )
    samples = None
    if any(e.sample is not None for e in encs):  # -1 where not given
        none = [torch.full((len(item_features(e)),), -1, device=dev) for e in encs]
        samples = torch.cat(
            [s if e.sample is None else e.sample.to(dev) for e, s in zip(encs, none)]
        )

    def resize(sizes: list[int], tail: list[int] | None):
        k = len(tail or ()) - (len(items) if samples is not None else 0)
        per_item, tied = (tail or [])[:k], (tail or [])[k:]
        feats: list[torch.Tensor] = []
        for m in mods:
            enc = encoded[m.name]
            if enc.counts is None:
                feats += enc.features
            else:
                n = int(enc.counts.shape[0])
                feats += cut_counted(enc.features[0], sizes[len(feats) : len(feats) + n])
        got = [replace(it, num_features=int(f.shape[0])) for it, f in zip(items, feats)]
        if tied and min(tied) >= 0 and items[0].sample is None:  # all tied; set_items first
            got = [replace(it, sample=s) for it, s in zip(got, tied)]
        if width:  # each run's length, zero past the item's runs
            cuts = [
                [x for x in per_item[i * width : (i + 1) * width] if x] for i in range(len(got))
            ]
        elif any(r > 1 for r in per_item):  # r runs of an equal share each
            cuts = [[f.shape[0] // max(r, 1)] * r for f, r in zip(feats, per_item)]
        else:
            return got, feats, parent, range(len(got))
        out_items, out_feats, out_parent, source = [], [], [], []
        for i, (it, f, p, cut) in enumerate(zip(got, feats, parent, cuts)):
            pieces = f.split(cut) if len(cut) > 1 and sum(cut) == f.shape[0] else (f,)
            out_items += [replace(it, num_features=int(x.shape[0])) for x in pieces]
            out_feats += pieces
            out_parent += [p] * len(pieces)
            source += [i] * len(pieces)
        return out_items, out_feats, out_parent, source

    return torch.cat(parts), runs, resize, torch.cat(probe) if probe else None, samples
