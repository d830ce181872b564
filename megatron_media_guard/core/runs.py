"""Placeholder runs and structural findings, parsed on the tensor's own device: elementwise
work, scans and gathers over the ids, no Python loop over tokens. ``TokenLayout`` holds the
per-token masks that the aligned check (``verify.py``) and the full parse start from; the
full parse moves only the run table and the findings to the host (sized by the runs).

Marker pairs nested right inside another pair's region (``Grammar.inner``) are read as part
of the outer region's markers (neither opens, closes nor is text): they must pair up."""

from __future__ import annotations

import functools
from functools import cached_property
from typing import NamedTuple

import torch

from ..errors import MediaInputError
from .cache import kept
from .grammar import Grammar
from .host import to_host
from .parsed import Finding, FindingKind, ParsedRuns, Run

_FITS: dict[tuple[int, torch.dtype], Grammar] = {}  # grammars whose ids fit a dtype


class Nested(NamedTuple):
    """``[b, s]`` bool masks of the nested markers (``Grammar.inner``): starts and ends."""

    start: torch.Tensor
    end: torch.Tensor


def _check_fits(grammar: Grammar, dtype: torch.dtype) -> Grammar:
    """Every special id of ``grammar`` fits ``dtype`` (else comparisons wrap)."""
    info = torch.iinfo(dtype)
    special = [*grammar.placeholders.values(), *grammar.break_ids]
    special += [*grammar.start_ids, *grammar.end_ids]
    bad = [t for t in special if not info.min <= t <= info.max]
    if bad:
        raise MediaInputError(
            f"grammar token ids {bad} do not fit input_ids of dtype {dtype} "
            f"([{info.min}, {info.max}]): comparing would wrap around"
        )
    return grammar


class TokenLayout:
    """Per-token masks of ``[b, s]`` ids (``[s]``: one row) on their device, built when read.
    cu_seqlens: ``[n+1]`` offsets of packed samples into the one row (tokens from
    ``cu_seqlens[-1]`` on are padding). Scans run along each row; packed boundaries apply
    where a scan result is read."""

    def __init__(
        self, ids: torch.Tensor, grammar: Grammar, cu_seqlens: torch.Tensor | None = None
    ) -> None:
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise MediaInputError(f"input_ids must be [b, s], got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise MediaInputError(f"input_ids must hold integer token ids, got {ids.dtype}")
        b, s = ids.shape
        if b == 0 or s == 0:
            raise MediaInputError(f"empty batch: input_ids has shape {tuple(ids.shape)}")
        kept(_FITS, 64, (id(grammar), ids.dtype), lambda: _check_fits(grammar, ids.dtype))
        self.grammar = grammar
        self.batch, self.row_length = b, s
        self.device = dev = ids.device
        self.ids = ids  # the masks below are built on first use (verify_lut needs none)

        # samples: [b, s] rows, or packed samples of one row
        self.packed = cu_seqlens is not None
        if cu_seqlens is None:
            self.num_samples = b  # ``sample`` (the row index) is built on first use
            self.seg_start = None  # rows are the samples: scans along dim 1 need no reset
            self.boundary = None
        else:
            if b != 1:
                raise MediaInputError(
                    f"packed input (cu_seqlens) must be one row [1, T], got {tuple(ids.shape)}"
                )
            cu = cu_seqlens
            if cu.dim() != 1 or cu.numel() < 2:
                raise MediaInputError(
                    f"cu_seqlens must be [num_samples + 1], got shape {tuple(cu.shape)}"
                )
            if cu.is_floating_point() or cu.dtype == torch.bool:
                raise MediaInputError(f"cu_seqlens must be integer offsets, got {cu.dtype}")
            if cu.device != dev:
                raise MediaInputError(f"cu_seqlens is on {cu.device}, input_ids on {dev}")
            self.cu = cu = cu.to(torch.int64)
            self.num_samples = cu.numel() - 1
            # sample index; tokens at or past cu[-1] get num_samples (padding)
            self.sample = (torch.searchsorted(cu, self.col, right=True) - 1).clamp(min=0)
            # the row's end by a fill on the device: a tensor from a host list would copy and sync
            bounds = torch.cat([cu, torch.full((1,), s, dtype=cu.dtype, device=cu.device)])
            self.seg_start = bounds[self.sample]
            self.seg_end = bounds[self.sample + 1]
            self.boundary = self.col == self.seg_start  # first token of a packed sample

    # ---- masks (built on first read) -------------------------------------------

    @cached_property
    def _masks(self) -> list[torch.Tensor]:  # one placeholder mask per modality
        return [self.ids == tok for tok in self.grammar.placeholders.values()]

    @cached_property
    def ph(self) -> torch.Tensor:  # [b, s] bool: any placeholder
        return functools.reduce(torch.logical_or, self._masks)

    @cached_property
    def content(self) -> torch.Tensor:  # placeholders and breaks
        breaks = self._any_of(self.grammar.break_ids)
        return self.ph if breaks is None else self.ph | breaks

    @cached_property
    def is_start(self) -> torch.Tensor | None:  # a nested start (Grammar.inner) opens none
        out = self._any_of(self.grammar.start_ids)
        return out if self.nested is None else out & ~self.nested.start

    @cached_property
    def is_end(self) -> torch.Tensor | None:
        out = self._any_of(self.grammar.end_ids)
        return out if self.nested is None else out & ~self.nested.end

    @cached_property
    def nested(self) -> Nested | None:
        """Inner starts right after an outer start, inner ends right before an outer end."""
        g = self.grammar
        if not g.inner:
            return None
        starts, ends = zip(*g.inner)
        outer_start = self._any_of(tuple(t for t in g.start_ids if t not in starts))
        outer_end = self._any_of(tuple(t for t in g.end_ids if t not in ends))
        start = self._any_of(starts) & self.prev(outer_start)
        end = self._any_of(ends) & self.next(outer_end)
        return Nested(start, end)

    @cached_property
    def marked(self) -> torch.Tensor:
        """``[b, s]`` bool: content or a marker, nested ones included (none of them is text: a
        run before ``<|audio_end|>`` is closed)."""
        out = self.content
        for t in (self.is_start, self.is_end):
            if t is not None:
                out = out | t
        return out if self.nested is None else out | self.nested.start | self.nested.end

    @cached_property
    def padding(self) -> torch.Tensor:  # [b, s] bool: past the last packed sample
        return self.sample == self.num_samples

    @cached_property
    def sample_end(self) -> torch.Tensor:  # [b, s] bool: the last token of its sample
        return self.next(torch.zeros_like(self.ph), fill=True)

    def _any_of(self, toks: tuple[int, ...]) -> torch.Tensor | None:
        if not toks:
            return None
        out = self.ids == toks[0]
        for t in toks[1:]:  # extra marker pairs (Grammar.regions): one compare each
            out = out | (self.ids == t)
        return out

    # ---- helpers ---------------------------------------------------------------

    @cached_property
    def code(self) -> torch.Tensor:
        """``[b, s]`` int8: -1 text, k for ``grammar.modalities[k]``."""
        code = torch.full((self.batch, self.row_length), -1, dtype=torch.int8, device=self.device)
        for k, m in enumerate(self._masks):
            code.masked_fill_(m, k)
        return code

    @cached_property
    def col(self) -> torch.Tensor:  # [b, s] position within the row (a view)
        return torch.arange(self.row_length, device=self.device).expand(self.batch, -1)

    @cached_property
    def sample(self) -> torch.Tensor:  # [b, s] sample of each token (packed: set in __init__)
        return torch.arange(self.batch, device=self.device)[:, None].expand(-1, self.row_length)

    def prev(self, x: torch.Tensor, fill: bool | int = False) -> torch.Tensor:
        """``x`` shifted one token right within its sample (``fill`` at a sample's first token)."""
        out = torch.constant_pad_nd(x[:, :-1], (1, 0), fill)
        if self.boundary is not None:
            out = out.masked_fill(self.boundary, fill)
        return out

    def next(self, x: torch.Tensor, fill: bool | int = False) -> torch.Tensor:
        """``x`` shifted one token left within its sample (``fill`` at a sample's last token)."""
        out = torch.constant_pad_nd(x[:, 1:], (0, 1), fill)
        if self.boundary is not None:  # the next token starts a sample
            out = out.masked_fill(torch.constant_pad_nd(self.boundary[:, 1:], (0, 1), False), fill)
        return out

    def last_before(self, mask: torch.Tensor, *, inclusive: bool) -> torch.Tensor:
        """Column of the last True at or before (``inclusive``) / before each token, within its
        sample; -1 when none. Off the aligned path: ``nonzero`` syncs."""
        k = torch.cumsum(mask, 1)  # marks so far in the row
        if not inclusive:
            k = k - mask.to(k.dtype)
        cols = torch.nonzero(mask)[:, 1]  # row-major: row r's marks are contiguous
        if cols.numel() == 0:
            return torch.full_like(k, -1)
        counts = k[:, -1:] if inclusive else k[:, -1:] + mask[:, -1:].to(k.dtype)
        first_of_row = torch.cumsum(counts, 0) - counts  # [b, 1] index of the row's first mark
        idx = (first_of_row + k - 1).clamp(min=0)
        last = torch.where(k > 0, cols[idx], -1)
        if self.seg_start is not None:
            last = torch.where(last >= self.seg_start, last, -1)
        return last

    def _depth(self, opens: torch.Tensor, closes: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` int32 ``cumsum(opens - closes)`` within each token's sample."""
        i32 = torch.int32
        d = torch.cumsum(opens, 1, dtype=i32) - torch.cumsum(closes, 1, dtype=i32)
        if self.seg_start is None:
            return d
        first = self.seg_start  # minus the depth before the sample's first token
        return d - torch.where(first > 0, d.gather(1, (first - 1).clamp(min=0)), 0)

    def structure_violations(self, run_start: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
        """Device scalar, no sync: 0 exactly when :meth:`finding_codes` finds nothing. With
        both markers the depth ``d = cumsum(start - end)`` decides: it stays in {0, 1}, is 1 on
        content and 0 at each sample's end, no run inside a region is followed by text and
        none holds breaks alone; without, the finding codes are counted (no ``last_before``)."""
        g = self.grammar
        if g.start_id is None or g.end_id is None:
            count = (self.finding_codes(run_start, run_end) != 0).sum()
            return count if self.seg_start is None else count + self.cu_violations()
        d = self._depth(self.is_start, self.is_end)
        if self.seg_start is None:
            # d outside {0, 1}, or content where d != 1: d < content (as 0/1) or d > 1
            bad = (d < self.content) | (d > 1)
            count = torch.count_nonzero(bad) + torch.count_nonzero(d[:, -1])
        else:
            bad = (d < 0) | (d > 1) | (self.content & (d != 1))
            bad = bad | (self.sample_end & (d != 0)) | (self.padding & self.marked)
            count = bad.sum() + self.cu_violations()
        if self.nested is not None:  # nested starts and ends pair up: depth in {0, 1}, 0 at ends
            x = self._depth(self.nested.start, self.nested.end)
            count = count + torch.count_nonzero((x < 0) | (x > 1) | (self.is_end & (x != 0)))
        if g.break_ids:
            count = count + self.empty_run_ends(run_start, run_end).sum()
        return count + torch.count_nonzero(run_end & ~self.next(self.marked, fill=True))

    def last_in_sample(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` read at the last token of each token's sample."""
        if self.seg_start is None:
            return x[:, -1:].expand_as(x)
        return x.gather(1, (self.seg_end - 1).clamp(min=0))

    # ---- runs ----------------------------------------------------------------

    def run_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(run_start, run_end)`` boolean ``[b, s]``: first and last content token of each run."""
        if self.grammar.collapsed:
            return self.ph, self.ph
        before = self.prev(self.content)
        if len(self.grammar.placeholders) == 1:
            start = self.content & ~before
        else:  # a modality switch starts a new run (no breaks: they come with one modality)
            # the modality of each placeholder: with two, the second one's mask (no int8 pass)
            key = self._masks[1] if len(self._masks) == 2 else self.code
            start = self.content & (~before | (self.prev(key) != key))
        end = self.content & (~self.next(self.content) | self.next(start))
        return start, end

    def runs_per_sample(self, run_start: torch.Tensor) -> torch.Tensor:
        """``[num_samples]`` int64: how many runs start in each sample (padding excluded)."""
        if self.seg_start is None:
            return torch.count_nonzero(run_start, dim=1)
        counts = torch.zeros(self.num_samples + 1, dtype=torch.int64, device=self.device)
        counts.scatter_add_(0, self.sample.reshape(-1), run_start.reshape(-1).long())
        return counts[: self.num_samples]

    # ---- findings --------------------------------------------------------------

    def cu_violations(self, cu: torch.Tensor | None = None) -> torch.Tensor:
        """Scalar: packed offsets (``cu``, else the layout's, on its device) that do not start at
        0, decrease, or pass the row end."""
        if self.seg_start is None:
            return torch.zeros((), dtype=torch.int64, device=self.device)
        cu = self.cu if cu is None else cu
        return (cu[0] != 0).long() + (cu[1:] < cu[:-1]).sum() + (cu[-1] > self.row_length).long()

    def check_cu_on_host(self) -> None:
        """Off the aligned path: a clear error for bad packed offsets (one small transfer)."""
        if self.seg_start is None:
            return
        cu = to_host(self.cu, why="validate packed offsets")
        if self.cu_violations(cu):
            cu, s = cu.tolist(), self.row_length
            raise MediaInputError(
                f"cu_seqlens must start at 0, never decrease and end within the row ({s} "
                f"tokens), got {cu[:16]}{' ...' if len(cu) > 16 else ''}",
                context={"cu_seqlens": cu[:64], "row_length": s},
            )

    def empty_run_ends(self, run_start: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` bool, no sync: the last token of each run of breaks alone (there the
        latest placeholder so far belongs to an earlier run)."""
        run_idx = torch.cumsum(run_start, 1)  # 1-based run index within the row
        last_ph_run = torch.cummax(torch.where(self.ph, run_idx, 0), 1).values
        return run_end & (last_ph_run != run_idx)

    def finding_codes(self, run_start: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` int8: a :class:`FindingKind` at each malformed position, else 0 (where
        several apply, the earliest listed below wins)."""
        g = self.grammar
        marks: list[tuple[torch.Tensor, FindingKind]] = []
        if self.packed:
            marks.append((self.padding & self.marked, FindingKind.IN_PADDING))
        if g.start_id is not None and g.end_id is not None:
            marker = self.is_start | self.is_end
            last_m = self.last_before(marker, inclusive=False)
            inside = (last_m >= 0) & self.is_start.gather(1, last_m.clamp(min=0))
            marks.append((self.is_start & inside, FindingKind.NESTED_START))
            marks.append((self.is_end & ~inside, FindingKind.END_WITHOUT_START))
            marks.append((self.content & ~inside, FindingKind.OUTSIDE_REGION))
            # a start that is its sample's last marker was never closed: cut
            last_marker = self.last_in_sample(self.last_before(marker, inclusive=True))
            marks.append((self.is_start & (last_marker == self.col), self._cut_kind()))
            # a run followed by text while its region is open and a marker still comes
            # later in the sample: the end token is missing (no later marker: it was cut)
            text_next = ~self.next(self.marked, fill=True)
            unterminated = run_end & text_next & inside & (last_marker > self.col)
            marks.append((unterminated, FindingKind.UNTERMINATED))
            if self.nested is not None:  # the open region began nested: its end comes nested
                after = (last_m + 1).clamp(max=self.row_length - 1)
                opened = inside & self.nested.start.gather(1, after)
                unclosed = self.is_end & opened & ~self.prev(self.nested.end)
                marks.append((unclosed, FindingKind.UNTERMINATED))
                marks.append((self.nested.end & ~opened, FindingKind.END_WITHOUT_START))
        elif g.end_id is not None:
            # end-only grammar (Pixtral): every run is closed by the end token right after it
            at_last = run_end & self.sample_end
            marks.append((at_last, self._cut_kind()))
            marks.append((run_end & ~at_last & ~self.next(self.is_end), FindingKind.UNTERMINATED))
            marks.append((self.is_end & ~self.prev(self.content), FindingKind.END_WITHOUT_START))
        if g.break_ids:
            marks.append((self.empty_run_ends(run_start, run_end), FindingKind.EMPTY_RUN))
        codes = torch.zeros_like(self.code)
        for mask, kind in reversed(marks):
            if isinstance(kind, FindingKind):
                codes = codes.masked_fill(mask, int(kind))
            else:
                codes = torch.where(mask, kind, codes)
        return codes

    def _cut_kind(self) -> FindingKind | torch.Tensor:
        """Cut by the row end, or (packed, before the row's end) by a sample boundary."""
        if self.seg_start is None:
            return FindingKind.CUT_BY_ROW_END
        return torch.where(
            self.seg_end == self.row_length,
            int(FindingKind.CUT_BY_ROW_END),
            int(FindingKind.CUT_BY_BOUNDARY),
        ).to(torch.int8)


def run_table(
    lay: TokenLayout, start: torch.Tensor, end: torch.Tensor, size: int | None = None
) -> torch.Tensor:
    """``[runs, 6]`` int64 in token order: each run's row, first and last column, placeholder
    count (breaks excluded), modality code of its first token (-1: breaks only) and sample.
    ``start`` / ``end``: :meth:`TokenLayout.run_bounds`. ``size``: the rows fixed in advance
    (no sync: the first ``size`` runs, rows past the last run meaningless), for a caller that
    reads the table with other values."""
    ph_cum = torch.cumsum(lay.ph, 1)
    # nonzero sizes its output by the number of runs (a sync on CUDA; nonzero_static with a
    # size known on the host does not); row-major order, so starts and ends pair up
    if size is None:
        st, en = torch.nonzero(start), torch.nonzero(end)
    else:
        st = torch.nonzero_static(start, size=size, fill_value=0)
        en = torch.nonzero_static(end, size=size, fill_value=0)
    sr, sc, ec = st[:, 0], st[:, 1], en[:, 1]
    lengths = ph_cum[sr, ec] - ph_cum[sr, sc] + lay.ph[sr, sc].to(ph_cum.dtype)
    # a run opens with a placeholder, or with a break (-1) in a grammar of one modality (0)
    first_code = lay.code[sr, sc].long().clamp(min=0)
    first_code = torch.where(lengths == 0, -1, first_code)  # breaks only: no modality
    return torch.stack([sr, sc, ec, lengths, first_code, lay.sample[sr, sc]], dim=1)


def runs_of(rows: list[list[int]], grammar: Grammar) -> list[Run]:
    """The runs of host rows of :func:`run_table`, each with an optional key column."""
    names = grammar.modalities
    return [
        Run(smp, row, a, e + 1, n, names[c] if c >= 0 else "break", *key)
        for row, a, e, n, c, smp, *key in rows
    ]


def parse_runs(
    input_ids: torch.Tensor, grammar: Grammar, cu_seqlens: torch.Tensor | None = None
) -> ParsedRuns:
    """Every placeholder run (token order) and structural finding, on the host.
    input_ids: ``[b, s]`` (``[1, T]`` with ``cu_seqlens`` ``[n+1]``), integer, any device."""
    return parse_layout(TokenLayout(input_ids, grammar, cu_seqlens))


def parse_layout(lay: TokenLayout) -> ParsedRuns:
    lay.check_cu_on_host()
    start, end = lay.run_bounds()
    # the cheap structure check decides whether the exact (costlier) findings are needed
    malformed = bool(to_host(lay.structure_violations(start, end), why="any malformed structure"))
    codes = lay.finding_codes(start, end) if malformed else None
    table = run_table(lay, start, end)
    if codes is not None:
        fr, fc = torch.nonzero(codes).unbind(1)
        ftab = torch.stack([fr, fc, codes[fr, fc].long(), lay.sample[fr, fc]], dim=1)
    else:
        ftab = table.new_empty(0, 4)
    # one transfer of the run table and the findings: sized by runs + findings, not tokens
    host = to_host(torch.cat([table.reshape(-1), ftab.reshape(-1)]), why="run table for diagnosis")
    nr = table.shape[0]
    rt = host[: nr * 6].view(nr, 6).tolist()
    ft = host[nr * 6 :].view(-1, 4).tolist()
    g = lay.grammar
    runs = tuple(runs_of(rt, g))
    findings = tuple(  # Finding(kind, sample, row, position)
        Finding(FindingKind(kind), None if smp >= lay.num_samples else smp, row, col)
        for row, col, kind, smp in ft
    )
    return ParsedRuns(
        runs, findings, lay.num_samples, lay.row_length, lay.packed, g.aliases, g.collapsed
    )
