"""Sub-samples of a packed THD row (Megatron-Bridge's Nemotron Omni in-batch packing), and the
call's samples as core's :class:`~...core.runs.TokenLayout` (rows, or packed sub-samples by
their compact or merged boundaries), on which the drop rewrites and masks. How the compact
boundaries are found (``position_ids`` resets, else two walks of the expansion):
docs/MEGATRON.md, Samples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch

from ...core.grammar import Grammar
from ...core.runs import TokenLayout

i64 = torch.int64
PAD_TOKEN = 0  # what megatron-core's forward embeds at image-token positions


@functools.lru_cache(maxsize=16)
def llava_grammar(token: int, modality: str = "image") -> Grammar:
    """megatron-core LLaVA's collapsed grammar: one token per image (or, ``modality="sound"``,
    one per sound row)."""
    if modality == "image":
        return Grammar.llava(int(token))
    return Grammar({modality: int(token)}, collapsed=True, name="llava")


@dataclass(frozen=True)
class Span:
    """Where one sample lies: compact token columns ``[start, end)`` of ``row`` and merged
    (expanded) positions ``[merged_start, merged_end)``. ``resolved``: false for a packed
    sub-sample whose expansion does not fill its ``cu_seqlens`` span."""

    row: int
    start: int
    end: int
    merged_start: int
    merged_end: int
    resolved: bool = True


@dataclass(frozen=True)
class Boundaries:
    """Compact start column of each sub-sample (and the row end); ``unmatched``: the
    sub-samples whose expansion does not (or cannot be shown to) fill their span."""

    pos: tuple[int, ...]
    unmatched: tuple[int, ...] = ()


def sample_layout(
    ids: torch.Tensor, grammar: Grammar, spans, packed: bool, merged: bool = False
) -> TokenLayout:
    """The call's samples over ``ids`` ``[b, s]``: rows, or the sub-samples' compact columns
    (``merged``: their merged spans, ``ids`` megatron-core's expanded output)."""
    cu = None
    if packed:
        ends = [(sp.merged_start, sp.merged_end) if merged else (sp.start, sp.end) for sp in spans]
        cu = torch.tensor([start for start, _ in ends] + [ends[-1][1]]).to(ids.device)
    return TokenLayout(ids, grammar, cu)


def merged_layout(spans, packed: bool, shape: tuple[int, int], device) -> TokenLayout:
    """The call's samples in megatron-core's expanded output ``[b, S]`` (rows, or the
    sub-samples' merged spans); only the layout's samples are read, not its tokens."""
    ids = torch.zeros(shape, dtype=i64, device=device)
    return sample_layout(ids, llava_grammar(-200), spans, packed, merged=True)


def _landing(start, total, cu, lens_rev, s):
    """Compact index of each boundary of ``cu`` found from the row's start (``f``; ``lf``:
    a token starts exactly there) and from its end (``g``, ``lg``)."""
    f = torch.searchsorted(start, cu)
    lf = (f < s) & (start.gather(0, f.clamp(max=s - 1)) == cu)
    f[-1], lf[-1] = s, total == cu[-1]  # the last sub-sample ends with the row
    suf = torch.flip(torch.cumsum(torch.flip(lens_rev, [0]), 0), [0])  # merged length from t
    dist = cu[-1] - cu
    asc = torch.flip(suf, [0])
    j = torch.searchsorted(asc, dist)
    g = torch.where(dist == 0, torch.full_like(j, s), s - 1 - j)
    lg = (dist == 0) | ((j < s) & (asc.gather(0, j.clamp(max=s - 1)) == dist))
    g[0], lg[0] = 0, (g[0] == 0) & lg[0]  # the first sub-sample starts with the row
    return f, lf, g, lg


def _from_positions(pos: torch.Tensor, s: int) -> torch.Tensor:
    """Sub-sample of each of the ``s`` columns (k: after the last) from the compact starts
    ``pos``, as :class:`TokenLayout` numbers them (not built here: a host copy)."""
    col = torch.arange(s, device=pos.device)
    return (torch.searchsorted(pos, col, right=True) - 1).clamp(min=0)


def device_segments(
    *,
    start: torch.Tensor,
    lens_rev: torch.Tensor,
    total: torch.Tensor,
    cu: torch.Tensor,
    position_ids: torch.Tensor | None,
    boundaries: Boundaries | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(sample of each token [1, s] (k: after the last), facts to bring to the host)``
    for one row: ``start`` ``[s]`` is each token's first merged position, ``lens_rev`` its
    expansion with entries assigned from the end."""
    s, k = start.numel(), cu.numel() - 1
    parts: dict[str, torch.Tensor] = {"cu": cu}
    if boundaries is not None:
        sample_of = _from_positions(torch.tensor(boundaries.pos, dtype=i64).to(cu.device), s)
    else:
        f, lf, g, lg = _landing(start, total, cu, lens_rev, s)
        parts.update(f=f, lf=lf, g=g, lg=lg)
        sample_of = _from_positions(f, s)
        if position_ids is not None and position_ids.numel() == s:
            resets = position_ids.reshape(-1).to(cu.device) == 0
            # one reset per sub-sample, the first at column 0: chosen on the device (no sync)
            ok = (resets.sum() == k) & resets[0]
            by_reset = (torch.cumsum(resets.to(i64), 0) - 1).clamp(0, k)
            sample_of = torch.where(ok, by_reset, sample_of)
            parts["resets_ok"] = ok.view(1)
    return sample_of.view(1, s), parts


def _fits(h: dict[str, tuple[int, ...]], spans_of: list[int]) -> list[bool]:
    """Which sub-samples' expansion fills their span. When the image tokens and entries
    agree in number, token order is right everywhere; else it is right up to the first wrong
    sub-sample, and the entries counted from the end are right after the last one."""
    k = len(spans_of)
    fwd = [h["nexp"][i] == spans_of[i] for i in range(k)]
    if sum(h["tokens"]) == len(h["entries"]):
        return fwd
    bwd = [h["nexp_rev"][i] == spans_of[i] for i in range(k)]
    lead = next((i for i, ok in enumerate(fwd) if not ok), k)
    trail = next((i for i in range(k - 1, -1, -1) if not bwd[i]), -1) + 1
    return [i < lead or i >= trail for i in range(k)]


def host_spans(h: dict[str, tuple[int, ...]], s: int) -> tuple[Span, ...] | Boundaries:
    """The sub-samples' spans, or the boundaries to count again with (second pass)."""
    cu = h["cu"]
    k = len(cu) - 1
    pos = [0, *accumulate(h["ncols"])]  # compact start of each sub-sample
    fits = _fits(h, [cu[i + 1] - cu[i] for i in range(k)])

    def spans() -> tuple[Span, ...]:
        return tuple(Span(0, pos[i], pos[i + 1], cu[i], cu[i + 1], fits[i]) for i in range(k))

    if "f" not in h or h.get("resets_ok") == (1,):
        return spans()  # boundaries settled by a first pass, or one reset per sub-sample
    f, lf, g, lg = h["f"], h["lf"], h["g"], h["lg"]
    ok = [i in (0, k) or (lf[i] and lg[i] and f[i] == g[i]) for i in range(k + 1)]
    ok[k] = bool(lf[k])
    if all(ok) and all(fits):
        return spans()
    new, bad, i = [0] * (k + 1), [], 0
    while i < k:
        j = next(m for m in range(i + 1, k + 1) if ok[m] or m == k)
        end = f[j] if ok[j] else s
        new[i + 1 : j + 1] = [end] * (j - i)
        if j - i > 1 or not ok[j] or not fits[i]:
            bad += range(i, j)
        i = j
    new[k] = s if not ok[k] else f[k]
    return Boundaries(tuple(new), tuple(bad))
