"""Device-side facts of one LLaVA ``_preprocess_data`` call, moved to the host once
(:func:`measure`), per sample (a row, or a packed sub-sample, :mod:`.packed`), entry and clip.
Nothing here loops over tokens."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import accumulate
from typing import Any

import torch

from ...core.apply import nonfinite_flags
from ...core.host import scalars_to_host
from ...errors import MediaInputError
from .packed import Boundaries, Span, device_segments, host_spans

_BIG = 2**62


@dataclass(frozen=True)
class LlavaFacts:
    """Host-side facts of one call. Per sample: tokens (image), sound, text, cross_image /
    cross_end (the first image whose expansion ends past the max length, and that end;
    ``num_entries`` / 2**62 when none), sound_past (sound tokens placed past it), spans. Per
    entry: entries (``num_image_tiles``), entry_bad (units holding NaN/Inf). Per clip:
    clip_rows (rows megatron-core takes), clip_bad (rows holding NaN/Inf). The NaN/Inf
    counts are empty when not checked. sound_padded: megatron-core 0.19 takes every row of
    every clip (the sound model's ``config.sound_pad_to_clip_duration``)."""

    batch: int
    row_length: int
    packed: bool
    image_token_index: int
    sound_token_index: int | None
    sound_padded: bool
    img_seq_len: int
    max_len: int
    spans: tuple[Span, ...]
    tokens: tuple[int, ...]
    sound: tuple[int, ...]
    text: tuple[int, ...]
    cross_image: tuple[int, ...]
    cross_end: tuple[int, ...]
    sound_past: tuple[int, ...]
    entries: tuple[int, ...]
    entry_bad: tuple[int, ...] = ()
    clip_rows: tuple[int, ...] = ()
    clip_bad: tuple[int, ...] = ()

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @property
    def num_clips(self) -> int:
        return len(self.clip_rows)

    def token_owners(self) -> list[int]:
        """Sample of each image in token order (one per image token)."""
        return [smp for smp, k in enumerate(self.tokens) for _ in range(k)]


def _bad_per_group(bad_units: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """NaN/Inf units per consecutive group of ``sizes`` units (a cumulative-sum gather; at
    least one group)."""
    cum = torch.cat([bad_units.new_zeros(1), torch.cumsum(bad_units.to(torch.int64), 0)])
    ends = torch.cumsum(sizes, 0).clamp(0, cum.numel() - 1)
    return cum[ends] - cum[(ends - sizes).clamp(0, cum.numel() - 1)]


def measure(
    a: dict[str, Any],
    model: Any,
    *,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    check_finite: bool,
    boundaries: Boundaries | None = None,
) -> LlavaFacts:
    """Everything the checks need from the bound arguments ``a`` of one ``_preprocess_data``
    call, in one device-to-host transfer. The embeddings (first stage only):
    ``image_embeddings`` ``[img_seq_len, tiles, h]`` (``[sum(num_image_tiles), 1, h]`` with
    ``is_packed_dynamic_res``), ``sound_embeddings`` ``[T, clips, h]``. cu_seqlens: the
    sub-sample boundaries of one packed row, in merged positions (None: rows are samples)."""
    pre, packed_rows = bool(model.pre_process), bool(a.get("is_packed_dynamic_res"))
    input_ids, counts = a["input_ids"], a.get("num_image_tiles")
    image_token_index = int(a["image_token_index"])
    sound_token_index = getattr(model, "sound_token_index", None)
    sound_cfg = getattr(getattr(model, "sound_model", None), "config", None)
    sound_padded = bool(getattr(sound_cfg, "sound_pad_to_clip_duration", False))
    max_len = int(model._language_max_sequence_length)
    image_embeddings = a.get("image_embeddings") if pre else None
    sound_embeddings = a.get("sound_embeddings") if pre else None
    if not isinstance(sound_embeddings, torch.Tensor) or sound_embeddings.dim() != 3:
        sound_embeddings = None
    sound_lengths = a.get("sound_embeddings_len")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise MediaInputError(f"LLaVA input_ids must be [b, s], got {shape}")
    b, s = input_ids.shape
    dev = input_ids.device
    i64 = torch.int64
    ph = input_ids == image_token_index
    sp = input_ids == sound_token_index if sound_token_index is not None else torch.zeros_like(ph)
    cnt = torch.as_tensor(() if counts is None else counts).to(dev, i64).reshape(-1)
    n = cnt.numel()
    L = 1 if packed_rows else int(model.img_seq_len)
    img_idx = (torch.cumsum(ph.reshape(-1), 0) - 1).view(b, s)  # image index, token order
    valid = ph & (img_idx < n)

    def expand(idx: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        t = cnt.gather(0, idx.clamp(0, max(n - 1, 0)).reshape(-1)).view(b, s) if n else idx * 0
        return torch.where(ph, torch.where(ok, t, torch.zeros_like(t)) * L, torch.ones_like(t))

    lens = expand(img_idx, valid)  # megatron-core's expansion: image -> t * L, other -> 1
    last = torch.cumsum(lens, 1) - 1
    start = last - lens + 1
    row_total = last[:, -1] + 1

    packed = cu_seqlens is not None
    if packed:
        if b != 1:
            raise MediaInputError(f"packed cu_seqlens need input_ids [1, s], got [{b}, {s}]")
        cu = torch.as_tensor(cu_seqlens).to(dev, i64).reshape(-1)
        k = cu.numel() - 1
        rev = n - ph.sum() + img_idx  # entry of each image counted from the last one
        lens_rev = expand(rev, ph & (rev >= 0))
        sample_of, seg_parts = device_segments(
            start=start[0],
            lens_rev=lens_rev[0],
            total=row_total[0],
            cu=cu,
            position_ids=position_ids,
            boundaries=boundaries,
        )
    else:  # the rows are the samples
        k = b
        sample_of = torch.arange(b, device=dev).view(b, 1).expand(b, s)
    of = sample_of.reshape(-1)  # bin k collects a packed row's tokens after its last sub-sample

    def count(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(k + 1, dtype=i64, device=dev)
        return out.scatter_add_(0, of, x.reshape(-1).to(i64))[:k]

    def first(x: torch.Tensor, init: int) -> torch.Tensor:
        out = torch.full((k + 1,), init, dtype=i64, device=dev)
        return out.scatter_reduce_(0, of, x.reshape(-1), "amin")[:k]

    cross = valid & (last >= max_len)
    parts: dict[str, torch.Tensor] = {
        "tokens": count(ph),
        "sound": count(sp),
        "text": count(~(ph | sp)),
        "cross_image": first(torch.where(cross, img_idx, n), n),
        "cross_end": first(torch.where(cross, last + 1, _BIG), _BIG),
        "sound_past": count(sp & (start >= max_len)),
        "totals": row_total,
        "entries": cnt,
    }
    if check_finite and image_embeddings is not None and n:
        dims = (1, 2) if packed_rows else (0, 2)
        # one read of the features; an overflowing sum of finite values is only a false
        # alarm, settled exactly by :func:`refine_finite` off the aligned path
        unit_ok = torch.isfinite(image_embeddings.sum(dim=dims, dtype=torch.float32))
        parts["entry_bad"] = _bad_per_group(~unit_ok.to(dev), cnt)
    if sound_embeddings is not None:
        T, c = sound_embeddings.shape[0], sound_embeddings.shape[1]
        if sound_lengths is not None and not sound_padded:
            rows = torch.as_tensor(sound_lengths).to(dev, i64).reshape(-1)
        else:
            rows = torch.full((c,), T, dtype=i64, device=dev)
        parts["clip_rows"] = rows
        if check_finite and c and rows.numel() == c:
            per_row = sound_embeddings.sum(dim=2, dtype=torch.float32)  # [T, clips]
            used = torch.arange(T, device=per_row.device).view(T, 1) < rows.to(per_row.device)
            parts["clip_bad"] = (used & ~torch.isfinite(per_row)).sum(0).to(dev)
    if packed:  # per sub-sample: its columns, its expansion from the front and from the back
        ones = torch.ones_like(lens)
        parts.update(seg_parts, ncols=count(ones), nexp=count(lens), nexp_rev=count(lens_rev))
    # the one host sync of the aligned path: per-sample counts and per-item facts
    v = scalars_to_host(list(parts.values()), dev, why="LLaVA merge facts")
    h, o = {}, 0
    for name, p in parts.items():
        h[name], o = tuple(v[o : o + p.numel()]), o + p.numel()
    if packed:
        spans = host_spans(h, s)
        if isinstance(spans, Boundaries):  # a sub-sample does not fill its span: count again
            return measure(
                a,
                model,
                cu_seqlens=cu_seqlens,
                position_ids=position_ids,
                check_finite=check_finite,
                boundaries=spans,
            )
    else:
        spans = tuple(Span(r, 0, s, 0, t) for r, t in enumerate(h["totals"]))
    return LlavaFacts(
        batch=k,
        row_length=s,
        packed=packed,
        image_token_index=image_token_index,
        sound_token_index=None if sound_token_index is None else int(sound_token_index),
        sound_padded=sound_padded,
        img_seq_len=L,
        max_len=max_len,
        spans=spans,
        **{f.name: h[f.name] for f in fields(LlavaFacts) if f.name in h},
    )


def refine_finite(facts: LlavaFacts, a: dict[str, Any], sound_ok: bool) -> LlavaFacts:
    """Exact NaN/Inf flags for the entries and (``sound_ok``: their layout is right) clips the
    sums flagged in the bound arguments ``a`` (diagnose path only; reads only the flagged
    items' views, through core's per-view check)."""
    entry_bad, clip_bad = list(facts.entry_bad), list(facts.clip_bad)
    views: list[tuple[list[int], int, torch.Tensor]] = []  # (flags, index, view)
    if any(entry_bad):
        dim = 0 if a.get("is_packed_dynamic_res") else 1
        starts, emb = (0, *accumulate(facts.entries)), a["image_embeddings"]
        views += [
            (entry_bad, j, emb.narrow(dim, starts[j], facts.entries[j]))
            for j, x in enumerate(facts.entry_bad)
            if x
        ]
    if sound_ok:
        views += [
            (clip_bad, c, a["sound_embeddings"][: facts.clip_rows[c], c])
            for c, x in enumerate(facts.clip_bad)
            if x
        ]
    why = "which LLaVA images / clips hold NaN/Inf"
    for (flags, i, _), bad in zip(views, nonfinite_flags([v for *_, v in views], why=why)):
        flags[i] = int(bad)
    return replace(facts, entry_bad=tuple(entry_bad), clip_bad=tuple(clip_bad))
