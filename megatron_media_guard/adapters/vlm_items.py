"""Which feature goes to which run in one call of the family engine: the call's items in the
model's consumption order, the caller's ``set_items`` laid on them, their token order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..core.grammar import Grammar
from ..core.interleave import Run, queued, read_runs, take_per_run
from ..core.items import MediaItem
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError
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


def call_items(
    mods: Sequence[ModalitySpec], encoded: dict[str, Encoded], meta: Sequence[MediaItem] | None
) -> tuple[list[MediaItem], list[torch.Tensor], list[int] | None, list[int]]:
    """MediaItems and features in the model's consumption order (modality by modality); when
    ``set_items`` gave ``meta`` (one item per model-level item: a video, not its tubelets;
    the k-th of a modality describes the model's k-th), the items' order as listed there
    (taken as token order), else None; per item its model-level item (numbered per
    modality)."""
    items: list[MediaItem] = []
    feats: list[torch.Tensor] = []
    parent: list[int] = []
    first: dict[str, list[int]] = {}  # modality -> per model-level item, its first item index
    end: dict[str, int] = {}  # modality -> past its last item
    for m in mods:
        enc = encoded[m.name]
        pieces = _pieces(enc)
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
        starts = first[src.modality]
        lo, hi = starts[k], starts[k + 1] if k + 1 < len(starts) else end[src.modality]
        for i in range(lo, hi):
            items[i] = replace(
                items[i], sample=src.sample, sample_id=src.sample_id, source_hw=src.source_hw
            )
            order.append(i)
    return items, feats, order, parent


def _pieces(enc: Encoded) -> tuple[torch.Tensor, ...]:
    """The items' features; a ``counts`` block's as empty rows (counted with the verdict)."""
    if enc.counts is None:
        return enc.features
    (block,) = enc.features
    return (block.new_zeros((0, block.shape[-1])),) * int(enc.counts.shape[0])


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
        none = [torch.full((len(_pieces(e)),), -1, device=dev) for e in encs]
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


def typed_order(ids, grammar, mods, items: list[MediaItem], types) -> list[int] | None:
    """:func:`typed_runs_order` on the runs read from ``ids`` (one transfer sized by the runs),
    where ``types`` (``FamilySpec.token_types``) decide the order, else None."""
    if typed_keys(mods, types) is None:
        return None
    runs = read_runs(TokenLayout(ids, grammar), types)
    return typed_runs_order(runs, grammar, mods, items) if runs else None


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
