"""Placeholder runs and structural findings, parsed on the tensor's own device.

Everything here is elementwise work, cumulative scans and gathers over the
flattened token ids: no Python loop over tokens. ``TokenLayout`` holds the
per-token tensors that both the aligned-path verification (``verify.py``) and
the full parse below start from; the full parse moves only the run table and
the findings to the host, so its transfer is sized by the number of runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .errors import MediaInputError
from .grammar import Grammar
from .host import to_host


class FindingKind(enum.IntEnum):
    """Malformed structure found in token ids (codes are stable; names are public)."""

    NESTED_START = 1  # a start token inside an open region
    END_WITHOUT_START = 2  # an end token with no open region
    OUTSIDE_REGION = 3  # a placeholder (or break) outside any start/end region
    UNTERMINATED = 4  # a region or run not closed before the next text/marker
    CUT_BY_ROW_END = 5  # a region or run still open when the row ends
    CUT_BY_BOUNDARY = 6  # a region or run still open at a packed-sample boundary
    EMPTY_RUN = 7  # a run of break tokens holding no placeholder
    IN_PADDING = 8  # placeholder or marker after the last packed sample

    @property
    def label(self) -> str:
        return self.name.lower()


TRUNCATION_KINDS = frozenset({FindingKind.CUT_BY_ROW_END, FindingKind.CUT_BY_BOUNDARY})


@dataclass(frozen=True)
class Run:
    """One placeholder run. ``start``/``end`` are positions within ``row`` (end exclusive);
    ``length`` counts placeholder tokens (breaks excluded): the features it takes."""

    sample: int
    row: int
    start: int
    end: int
    length: int
    modality: str


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    sample: int | None
    row: int
    position: int

    def describe(self) -> str:
        where = "padding" if self.sample is None else f"sample {self.sample}"
        return f"{self.kind.label} at row {self.row} position {self.position} ({where})"


@dataclass(frozen=True)
class ParsedRuns:
    """Host-side result of :func:`parse_runs`: runs in token order, findings, sample count."""

    runs: tuple[Run, ...]
    findings: tuple[Finding, ...]
    num_samples: int
    row_length: int
    packed: bool


class TokenLayout:
    """Per-token masks of one batch of ids, flattened to ``[N = b*s]``, all on ``ids.device``.

    ids: ``[b, s]`` integer token ids (``[s]`` is taken as one row).
    cu_seqlens: optional ``[n+1]`` offsets of packed samples into the flattened ids
        (THD packing, ``b == 1``); tokens from ``cu_seqlens[-1]`` on are padding.
    """

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
        self.grammar = grammar
        self.batch, self.row_length = b, s
        dev = ids.device
        flat = ids.reshape(-1)
        n = flat.numel()
        self.num_tokens = n
        self.pos = torch.arange(n, device=dev)

        # modality code per token: -1 text, k for grammar.modalities[k]
        code = torch.full((n,), -1, dtype=torch.int8, device=dev)
        for k, tok in enumerate(grammar.placeholders.values()):
            code = torch.where(flat == tok, torch.tensor(k, dtype=torch.int8, device=dev), code)
        self.code = code
        self.ph = code >= 0
        brk = torch.zeros(n, dtype=torch.bool, device=dev)
        for tok in grammar.break_ids:
            brk |= flat == tok
        self.content = self.ph | brk
        self.is_start = (
            flat == grammar.start_id if grammar.start_id is not None else torch.zeros_like(brk)
        )
        self.is_end = (
            flat == grammar.end_id if grammar.end_id is not None else torch.zeros_like(brk)
        )

        # samples: [b, s] rows, or packed samples of one row
        self.packed = cu_seqlens is not None
        first = self.pos % s == 0
        if cu_seqlens is None:
            self.num_samples = b
            self.sample = self.pos // s
            self.seg_start = self.sample * s
            self.seg_end = self.seg_start + s
            self.at_row_end = torch.ones(n, dtype=torch.bool, device=dev)
        else:
            if b != 1:
                raise MediaInputError(
                    f"packed input (cu_seqlens) must be one row [1, T], got {tuple(ids.shape)}"
                )
            cu = _check_cu_seqlens(cu_seqlens, n, dev)
            self.num_samples = cu.numel() - 1
            # sample index; tokens at or past cu[-1] get num_samples (padding)
            self.sample = (torch.searchsorted(cu, self.pos, right=True) - 1).clamp(min=0)
            bounds = torch.cat([cu, cu.new_tensor([n])])
            self.seg_start = bounds[self.sample]
            self.seg_end = bounds[self.sample + 1]
            self.at_row_end = self.seg_end == n
            first = first | (self.pos == self.seg_start)
        self.first = first  # first token of a sample (or of the padding tail)
        last = torch.roll(first, -1)
        last[-1] = True
        self.last = last

    # ---- runs ----------------------------------------------------------------

    def run_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(run_start, run_end)`` boolean ``[N]``: first and last content token of each run."""
        if self.grammar.collapsed:
            return self.ph, self.ph
        prev_content = torch.roll(self.content, 1) & ~self.first
        prev_code = torch.roll(self.code, 1)
        switch = self.ph & torch.roll(self.ph, 1) & (prev_code != self.code)
        start = self.content & (~prev_content | switch)
        next_start = torch.roll(start, -1)
        next_content = torch.roll(self.content, -1) & ~self.last
        end = self.content & (~next_content | next_start)
        return start, end

    def run_placeholders(self, run_start: torch.Tensor) -> torch.Tensor:
        """``[N]``: placeholders from the start of the current run up to each position."""
        ph_cum = torch.cumsum(self.ph, 0)
        start_idx = _last_true_before(run_start, self.pos, inclusive=True).clamp(min=0)
        return ph_cum - (ph_cum - self.ph.to(ph_cum.dtype)).gather(0, start_idx)

    def run_codes(self) -> torch.Tensor:
        """``[N]`` int64: modality code of the first placeholder at or after each position
        (-1 if none); read at a run start, it is the run's modality (a run may open with a break)."""
        nxt = torch.where(self.ph, self.pos, _next_true_after(self.ph, self.pos))
        found = nxt < self.num_tokens
        return torch.where(
            found, self.code.gather(0, nxt.clamp(max=self.num_tokens - 1)).long(), -1
        )

    # ---- findings --------------------------------------------------------------

    def finding_codes(self, run_start: torch.Tensor, run_end: torch.Tensor) -> torch.Tensor:
        """``[N]`` int8: a :class:`FindingKind` code at each malformed position, 0 elsewhere."""
        g = self.grammar
        dev = self.code.device
        codes = torch.zeros(self.num_tokens, dtype=torch.int8, device=dev)

        def put(mask: torch.Tensor, kind: FindingKind) -> torch.Tensor:
            return torch.where(
                mask & (codes == 0), torch.tensor(int(kind), dtype=torch.int8, device=dev), codes
            )

        cut_kind = torch.where(
            self.at_row_end,
            torch.tensor(int(FindingKind.CUT_BY_ROW_END), dtype=torch.int8, device=dev),
            torch.tensor(int(FindingKind.CUT_BY_BOUNDARY), dtype=torch.int8, device=dev),
        )
        if self.packed:
            padding = self.sample == self.num_samples
            codes = put(
                padding & (self.content | self.is_start | self.is_end), FindingKind.IN_PADDING
            )

        # a run holding no placeholder (only breaks)
        codes = put(run_end & (self.run_placeholders(run_start) == 0), FindingKind.EMPTY_RUN)

        if g.start_id is not None and g.end_id is not None:
            marker = self.is_start | self.is_end
            last_m = _last_true_before(marker, self.pos, inclusive=False)
            has_last = last_m >= self.seg_start
            inside = has_last & self.is_start.gather(0, last_m.clamp(min=0))
            codes = put(self.is_start & inside, FindingKind.NESTED_START)
            codes = put(self.is_end & ~inside, FindingKind.END_WITHOUT_START)
            codes = put(self.content & ~inside, FindingKind.OUTSIDE_REGION)
            # a start whose sample holds no later marker: the region was cut
            next_m = _next_true_after(marker, self.pos)
            no_next = next_m >= self.seg_end
            cut = self.is_start & no_next
            codes = torch.where(cut & (codes == 0), cut_kind, codes)
            # content directly followed by text while its region is open: the end is missing
            nxt_tok_marker = torch.roll(marker, -1) & ~self.last
            nxt_content = torch.roll(self.content, -1)
            after_run_text = run_end & ~self.last & ~nxt_tok_marker & ~nxt_content & inside
            codes = put(after_run_text & ~no_next, FindingKind.UNTERMINATED)
        elif g.end_id is not None:
            # end-only grammar (Pixtral): every run is closed by the end token right after it
            next_is_end = torch.roll(self.is_end, -1) & ~self.last
            codes = torch.where(run_end & self.last & (codes == 0), cut_kind, codes)
            codes = put(run_end & ~self.last & ~next_is_end, FindingKind.UNTERMINATED)
            prev_content = torch.roll(self.content, 1) & ~self.first
            codes = put(self.is_end & ~prev_content, FindingKind.END_WITHOUT_START)
        return codes


def _check_cu_seqlens(cu: torch.Tensor, n: int, dev: torch.device) -> torch.Tensor:
    if cu.dim() != 1 or cu.numel() < 2:
        raise MediaInputError(f"cu_seqlens must be [num_samples + 1], got shape {tuple(cu.shape)}")
    if cu.is_floating_point() or cu.dtype == torch.bool:
        raise MediaInputError(f"cu_seqlens must be integer offsets, got {cu.dtype}")
    if cu.device != dev:
        raise MediaInputError(f"cu_seqlens is on {cu.device}, input_ids on {dev}")
    return cu.to(torch.int64)


def _last_true_before(mask: torch.Tensor, pos: torch.Tensor, *, inclusive: bool) -> torch.Tensor:
    """Index of the last True at or before (``inclusive``) / strictly before each position; -1 if none."""
    marked = torch.where(mask, pos, torch.full_like(pos, -1))
    last = torch.cummax(marked, 0).values
    if inclusive:
        return last
    return torch.cat([last.new_tensor([-1]), last[:-1]])


def _next_true_after(mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Index of the first True strictly after each position; N if none."""
    n = pos.numel()
    marked = torch.where(mask, pos, torch.full_like(pos, n))
    nxt = torch.flip(torch.cummin(torch.flip(marked, [0]), 0).values, [0])
    return torch.cat([nxt[1:], nxt.new_tensor([n])])


def parse_runs(
    input_ids: torch.Tensor, grammar: Grammar, cu_seqlens: torch.Tensor | None = None
) -> ParsedRuns:
    """Find every placeholder run and every structural finding.

    input_ids: ``[b, s]`` (or ``[1, T]`` with ``cu_seqlens`` ``[n+1]``), any integer dtype, any device.
    Returns host-side runs in token order; findings name the (packed) sample, row and position.
    """
    lay = TokenLayout(input_ids, grammar, cu_seqlens)
    return parse_layout(lay)


def parse_layout(lay: TokenLayout) -> ParsedRuns:
    start, end = lay.run_bounds()
    codes = lay.finding_codes(start, end)
    ph_cum = torch.cumsum(lay.ph, 0)
    # torch.nonzero sizes its output by the number of runs (a sync on CUDA).
    s_idx = torch.nonzero(start).squeeze(1)
    e_idx = torch.nonzero(end).squeeze(1)
    f_idx = torch.nonzero(codes).squeeze(1)
    lengths = ph_cum[e_idx] - ph_cum[s_idx] + lay.ph[s_idx].to(ph_cum.dtype)
    first_code = lay.run_codes()[s_idx]
    first_code = torch.where(lengths == 0, -1, first_code)  # breaks only: no modality
    table = torch.stack(
        [s_idx, e_idx, lengths.to(torch.int64), first_code, lay.sample[s_idx]], dim=1
    )
    ftab = torch.stack([f_idx, codes[f_idx].to(torch.int64), lay.sample[f_idx]], dim=1)
    # one transfer of the run table and the findings: sized by runs + findings, not tokens
    host = to_host(torch.cat([table.reshape(-1), ftab.reshape(-1)]), why="run table for diagnosis")
    nr = s_idx.numel()
    rt = host[: nr * 5].view(nr, 5).tolist()
    ft = host[nr * 5 :].view(-1, 3).tolist()
    s = lay.row_length
    names = lay.grammar.modalities
    runs = tuple(
        Run(
            sample=smp,
            row=st // s,
            start=st % s,
            end=en % s + 1,
            length=ln,
            modality=names[mc] if mc >= 0 else "break",
        )
        for st, en, ln, mc, smp in rt
    )
    findings = tuple(
        Finding(
            kind=FindingKind(kind),
            sample=None if smp >= lay.num_samples else smp,
            row=p // s,
            position=p % s,
        )
        for p, kind, smp in ft
    )
    return ParsedRuns(runs, findings, lay.num_samples, s, lay.packed)
