"""Device-side facts of one LLaVA ``_preprocess_data`` call, moved to the host once.

:func:`measure` reads the token ids, ``num_image_tiles``, the sound lengths and (on the
first stage) the image and sound embeddings, and reduces them per sample on their own
device: image / sound / text tokens, the first image whose expansion crosses
``language_max_sequence_length``, the sound tokens placed past it, per-entry and
per-clip NaN/Inf counts and, for a packed THD row, where each sub-sample of
``cu_seqlens`` starts in the compact token ids. One :func:`~..core.host.to_host` call
brings the lot to the host; nothing here loops over tokens.

Samples are the rows of ``input_ids`` or, for one packed row with ``cu_seqlens`` (in
the merged, expanded coordinates megatron-core's language model sees), its
sub-samples. A sub-sample boundary is found in the compact ids by expanding every token
the way megatron-core does (image token -> ``tiles * img_seq_len`` positions) and
looking for the token that starts exactly at ``cu_seqlens[i]``: once from the row's
start (entries assigned in token order) and once from its end (entries assigned from
the last image backwards). A sub-sample whose expansion disagrees with its span (a
wrong count, an extra or missing image token) is bracketed by boundaries found from the
two sides, so the fault names it and not the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.host import to_host
from ..errors import MediaInputError

_BIG = 2**62


@dataclass(frozen=True)
class Span:
    """Where one sample lies: compact token columns ``[start, end)`` of ``row`` and merged
    (expanded) positions ``[merged_start, merged_end)``. ``resolved``: false for a packed
    sub-sample whose expansion does not match its ``cu_seqlens`` span."""

    row: int
    start: int
    end: int
    merged_start: int
    merged_end: int
    resolved: bool = True


@dataclass(frozen=True)
class LlavaFacts:
    """Host-side facts of one call (see :func:`measure`).

    Per sample: tokens (image), sound, text, cross_image / cross_end (first image, in
    ``num_image_tiles`` order, whose expansion ends past the max length, and that end;
    ``num_entries`` / -1 when none), sound_past (sound tokens placed past the max
    length). Per entry: entries (``num_image_tiles``), entry_bad (units holding NaN/Inf;
    empty when not checked). Per clip: clip_rows (sound rows megatron-core takes from
    it), clip_bad (rows holding NaN/Inf; empty when not checked). spans: per sample.
    """

    batch: int
    rows: int
    row_length: int
    packed: bool
    image_token_index: int
    sound_token_index: int | None
    img_seq_len: int
    max_len: int
    tokens: tuple[int, ...]
    sound: tuple[int, ...]
    text: tuple[int, ...]
    cross_image: tuple[int, ...]
    cross_end: tuple[int, ...]
    sound_past: tuple[int, ...]
    entries: tuple[int, ...]
    entry_bad: tuple[int, ...]
    clip_rows: tuple[int, ...]
    clip_bad: tuple[int, ...]
    spans: tuple[Span, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @property
    def num_clips(self) -> int:
        return len(self.clip_rows)

    def without_entry_flags(self) -> LlavaFacts:
        """The facts with no NaN/Inf flags for the images (their layout is not known)."""
        return replace(self, entry_bad=())

    def token_owners(self) -> list[int]:
        """Sample of each image in token order (one per image token)."""
        return [smp for smp, k in enumerate(self.tokens) for _ in range(k)]


def _per_sample(values: torch.Tensor, sample_of: torch.Tensor, nbins: int) -> torch.Tensor:
    out = torch.zeros(nbins, dtype=torch.int64, device=values.device)
    return out.scatter_add_(0, sample_of.reshape(-1), values.reshape(-1).to(torch.int64))


def _per_sample_min(values, sample_of, nbins, init) -> torch.Tensor:
    out = torch.full((nbins,), init, dtype=torch.int64, device=values.device)
    return out.scatter_reduce_(0, sample_of.reshape(-1), values.reshape(-1), "amin")


def _bad_per_group(bad_units: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """NaN/Inf units per consecutive group of ``sizes`` units (a cumulative-sum gather)."""
    if sizes.numel() == 0:
        return sizes.new_zeros(0)
    cum = torch.cat([bad_units.new_zeros(1), torch.cumsum(bad_units.to(torch.int64), 0)])
    ends = torch.cumsum(sizes, 0).clamp(0, cum.numel() - 1)
    return cum[ends] - cum[(ends - sizes).clamp(0, cum.numel() - 1)]


def _landing(start, total, cu, lens_rev, s):
    """Compact index of each boundary of ``cu`` from the row's start (``f``, landed
    ``lf``) and from its end (``g``, landed ``lg``), for one row."""
    f = torch.searchsorted(start, cu)
    at = start.gather(0, f.clamp(max=s - 1))
    lf = (f < s) & (at == cu)
    f[-1], lf[-1] = s, total == cu[-1]  # the last sub-sample ends with the row
    suf = torch.flip(torch.cumsum(torch.flip(lens_rev, [0]), 0), [0])  # merged length from t
    dist = cu[-1] - cu
    asc = torch.flip(suf, [0])
    j = torch.searchsorted(asc, dist)
    g = torch.where(dist == 0, torch.full_like(j, s), s - 1 - j)
    lg = (dist == 0) | ((j < s) & (asc.gather(0, j.clamp(max=s - 1)) == dist))
    g[0], lg[0] = 0, (g[0] == 0) & lg[0]  # the first sub-sample starts with the row
    return f, lf, g, lg


def measure(
    input_ids: torch.Tensor,
    *,
    image_token_index: int,
    sound_token_index: int | None,
    counts: torch.Tensor | None,
    img_seq_len: int,
    max_len: int,
    image_embeddings: torch.Tensor | None,
    packed_rows: bool,
    sound_embeddings: torch.Tensor | None,
    sound_lengths: torch.Tensor | None,
    sound_padded: bool,
    cu_seqlens: torch.Tensor | None,
    check_finite: bool,
    boundaries: Boundaries | None = None,
) -> LlavaFacts:
    """Everything the checks need, in one device-to-host transfer.

    image_embeddings: ``[img_seq_len, tiles, h]``, or ``[sum(counts), 1, h]`` with
    ``packed_rows`` (megatron-core's ``is_packed_dynamic_res``), or None (not read: another
    stage, or the layout is wrong). sound_embeddings: ``[T, clips, h]`` as
    ``_preprocess_data`` receives it; sound_lengths: rows per clip (None: every row, as
    with ``sound_pad_to_clip_duration``). cu_seqlens: sub-sample boundaries of a single
    packed row, in merged positions (None: the rows are the samples).
    """
    call = dict(locals())
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise MediaInputError(f"LLaVA input_ids must be [b, s], got {shape}")
    b, s = input_ids.shape
    dev = input_ids.device
    i64 = torch.int64
    ph = input_ids == image_token_index
    sp = input_ids == sound_token_index if sound_token_index is not None else torch.zeros_like(ph)
    cnt = (
        torch.as_tensor(counts).to(dev, i64).reshape(-1)
        if counts is not None
        else torch.zeros(0, dtype=i64, device=dev)
    )
    n = cnt.numel()
    L = int(img_seq_len)
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
        if boundaries is None:
            rev = n - ph.sum() + img_idx  # entry of each image counted from the last one
            lens_rev = expand(rev, ph & (rev >= 0))
            f, lf, g, lg = _landing(start[0], row_total[0], cu, lens_rev[0], s)
            pos = f
        else:
            pos = torch.tensor(boundaries.pos, dtype=i64).to(dev)
        marker = torch.full((s + 1,), -1, dtype=i64, device=dev)
        marker.scatter_reduce_(0, pos[:k].clamp(0, s), torch.arange(k, device=dev), "amax")
        sample_of = torch.cummax(marker[:s], 0).values.clamp(min=0)
        after = torch.arange(s, device=dev) >= pos[k]
        sample_of = torch.where(after, torch.full_like(sample_of, k), sample_of).view(1, s)
        nb = k + 1  # the last bin collects tokens after the last sub-sample
    else:
        k = b
        sample_of = torch.arange(b, device=dev).view(b, 1).expand(b, s)
        nb = b
    cross = valid & (last >= max_len)
    cross_image = _per_sample_min(torch.where(cross, img_idx, n), sample_of, nb, n)
    cross_end = _per_sample_min(torch.where(cross, last + 1, _BIG), sample_of, nb, _BIG)
    cross_end = torch.where(cross_end == _BIG, torch.full_like(cross_end, -1), cross_end)
    parts: dict[str, torch.Tensor] = {
        "tokens": _per_sample(ph, sample_of, nb)[:k],
        "sound": _per_sample(sp, sample_of, nb)[:k],
        "text": _per_sample(~(ph | sp), sample_of, nb)[:k],
        "cross_image": cross_image[:k],
        "cross_end": cross_end[:k],
        "sound_past": _per_sample(sp & (start >= max_len), sample_of, nb)[:k],
        "totals": row_total,
        "entries": cnt,
    }
    if check_finite and image_embeddings is not None and n:
        dims = (1, 2) if packed_rows else (0, 2)
        # one read of the features; an overflowing sum of finite values is only a false
        # alarm, settled exactly by :func:`refine_finite` off the aligned path
        unit_ok = torch.isfinite(image_embeddings.sum(dim=dims, dtype=torch.float32))
        parts["entry_bad"] = _bad_per_group(~unit_ok.to(dev), cnt)
    if sound_embeddings is not None and sound_embeddings.dim() == 3:
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
    if packed:
        parts["cu"] = cu
        if boundaries is None:
            parts.update(f=f, lf=lf, g=g, lg=lg)
    # the one host sync of the aligned path: per-sample counts and per-item facts
    flat = to_host(torch.cat([p.to(i64) for p in parts.values()]), why="LLaVA merge facts")
    v, h, o = flat.tolist(), {}, 0
    for name, p in parts.items():
        h[name], o = tuple(v[o : o + p.numel()]), o + p.numel()
    if packed and boundaries is None:
        found = settle_boundaries(h["cu"], h["f"], h["lf"], h["g"], h["lg"], s)
        if found.pos != h["f"]:  # a sub-sample does not fill its span: count again
            return measure(**{**call, "boundaries": found})
        boundaries = found
    if packed:
        spans = boundaries.spans(h["cu"])
    else:
        spans = tuple(Span(r, 0, s, 0, t) for r, t in enumerate(h["totals"]))
    return LlavaFacts(
        batch=k,
        rows=b,
        row_length=s,
        packed=packed,
        image_token_index=int(image_token_index),
        sound_token_index=None if sound_token_index is None else int(sound_token_index),
        img_seq_len=L,
        max_len=int(max_len),
        tokens=h["tokens"],
        sound=h["sound"],
        text=h["text"],
        cross_image=h["cross_image"],
        cross_end=h["cross_end"],
        sound_past=h["sound_past"],
        entries=h["entries"],
        entry_bad=h.get("entry_bad", ()),
        clip_rows=h.get("clip_rows", ()),
        clip_bad=h.get("clip_bad", ()),
        spans=spans,
    )


@dataclass(frozen=True)
class Boundaries:
    """Compact start column of each sub-sample (and the row end), and the sub-samples
    whose span could not be matched by their expansion (``unmatched``, contiguous)."""

    pos: tuple[int, ...]
    unmatched: tuple[int, ...] = ()

    def spans(self, cu: tuple[int, ...]) -> tuple[Span, ...]:
        k = len(cu) - 1
        bad = set(self.unmatched)
        return tuple(
            Span(0, self.pos[i], self.pos[i + 1], cu[i], cu[i + 1], i not in bad) for i in range(k)
        )


def settle_boundaries(cu, f, lf, g, lg, s: int) -> Boundaries:
    """Sub-sample starts from the two landings (host side, a loop over sub-samples).

    Boundaries found from the start are right up to the first sub-sample whose expansion
    does not fill its span, those found from the end from the last one on. last_f: the last
    boundary with every forward landing up to it; first_g: the first with every backward landing
    from it. Sub-samples ``min(last_f, first_g-1) .. max(last_f, first_g-1)`` are unmatched: one of them (or
    several) expands differently than ``cu_seqlens`` says; their tokens go to the first.
    """
    k = len(cu) - 1
    if all(lf) and all(lg) and tuple(f) == tuple(g):
        return Boundaries(tuple(f))
    last_f = 0
    while last_f < k and lf[last_f + 1]:
        last_f += 1
    first_g = k
    while first_g > 0 and lg[first_g - 1]:
        first_g -= 1
    if last_f == k:
        return Boundaries(tuple(f))
    if first_g == 0:
        return Boundaries(tuple(g))
    lo, hi = min(last_f, first_g - 1), max(last_f, first_g - 1)
    a, e = f[lo], g[hi + 1]
    if e < a:  # the two sides overlap: nothing inside can be placed
        e = a
    pos = [f[i] for i in range(lo + 1)]
    pos += [a] * (hi - lo)  # the other unmatched sub-samples start (empty) where it ends
    pos[lo + 1 : hi + 1] = [e] * (hi - lo)
    pos += [g[i] for i in range(hi + 1, k + 1)]
    return Boundaries(tuple(pos), tuple(range(lo, hi + 1)))


def refine_finite(
    facts: LlavaFacts,
    image_embeddings: torch.Tensor | None,
    packed_rows: bool,
    sound_embeddings: torch.Tensor | None,
) -> LlavaFacts:
    """Exact NaN/Inf flags for the entries and clips the sums flagged (diagnose path only;
    reads only the flagged items' views)."""
    bad_e = [j for j, x in enumerate(facts.entry_bad) if x]
    bad_c = [c for c, x in enumerate(facts.clip_bad) if x]
    if not bad_e and not bad_c:
        return facts
    checks = []
    if bad_e and image_embeddings is not None:
        dim = 0 if packed_rows else 1
        starts = [0]
        for t in facts.entries:
            starts.append(starts[-1] + t)
        for j in bad_e:
            view = image_embeddings.narrow(dim, starts[j], facts.entries[j])
            checks.append((~torch.isfinite(view)).any())
    if bad_c and sound_embeddings is not None:
        for c in bad_c:
            view = sound_embeddings[: facts.clip_rows[c], c]
            checks.append((~torch.isfinite(view)).any())
    flags = to_host(torch.stack(checks), why="which LLaVA images / clips hold NaN/Inf").tolist()
    entry_bad, clip_bad = list(facts.entry_bad), list(facts.clip_bad)
    for j, bad in zip(bad_e, flags[: len(bad_e)]):
        entry_bad[j] = int(bad)
    for c, bad in zip(bad_c, flags[len(bad_e) :]):
        clip_bad[c] = int(bad)
    return replace(facts, entry_bad=tuple(entry_bad), clip_bad=tuple(clip_bad))
