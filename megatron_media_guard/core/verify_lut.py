"""The aligned-path check for marker grammars (Qwen-VL, InternVL) on CPU in a few fused ops.

Same verdict as ``verify.py``'s for start/end markers, no breaks, at most four modalities,
unpacked rows, in about a third of its torch ops (at short micro-batches op dispatch is
the cost): each token gets a class (text, start, end, placeholder m) from one lookup table;
each neighbour pair ``(class[t - 1], class[t])`` (rows padded with an edge class) indexes
per-pair tables of run start, run end and scan step. The scan ``y = cumsum(step)`` (twice
the depth, less the placeholder flag, shifted) stays in [-1, 1] exactly when the structure
is sound; an unterminated run adds a constant larger than any depth. Run ``r`` is checked
against item ``r`` by its positions (``nonzero``, host-sized at no cost on CPU).
"""

from __future__ import annotations

import torch

from .cache import constant, kept
from .grammar import Grammar

_EDGE = 7  # the class of the padding before a row's first token and after its last
_TEXT, _START, _END, _PH = 0, 1, 2, 3  # placeholder of modality m: class 3 + m

_BIG = 1 << 32  # the unterminated-run penalty: more than any |2 * depth| + 2 in a row
_MAX_ROW = 1 << 30  # rows up to this long keep the scan in int64 with that penalty

_TABLES: dict[tuple, tuple] = {}


def tables(grammar: Grammar, packed: bool, s: int, dev: torch.device) -> tuple | None:
    """The lookup tables for :func:`check` (cached), or None where the general check decides
    (see the module docstring; also nested pairs, ids spread too far, rows of 2**30 tokens)."""
    if s >= _MAX_ROW:
        return None
    return kept(
        _TABLES, 16, (id(grammar), packed, dev), lambda: (grammar, _build(grammar, packed, dev))
    )[1]


def _build(grammar: Grammar, packed: bool, dev: torch.device) -> tuple | None:
    ok = (
        dev.type == "cpu"
        and not packed
        and grammar.start_id is not None
        and grammar.end_id is not None
        and not grammar.break_ids
        and not grammar.collapsed
        and not grammar.inner
        and len(grammar.placeholders) <= 4
    )
    if ok:
        ids = [*grammar.start_ids, *grammar.end_ids, *grammar.placeholders.values()]
        ok = max(ids) - min(ids) <= 1 << 16
    if not ok:
        return None
    ids = {t: _START for t in grammar.start_ids}
    ids.update({t: _END for t in grammar.end_ids})
    ids.update({tok: _PH + m for m, tok in enumerate(grammar.placeholders.values())})
    lo, hi = min(ids), max(ids)
    cls = [_TEXT] * (hi - lo + 3)  # index 0: below lo, hi - lo + 2: above hi
    for tok, c in ids.items():
        cls[tok - lo + 1] = c
    start, end, step = [0] * 64, [0] * 64, [0] * 64
    for a in range(8):
        for b in range(8):
            q = a * 8 + b
            a_ph, b_ph = _PH <= a < _EDGE, _PH <= b < _EDGE
            start[q] = b - _PH + 1 if b_ph and a != b else 0  # modality + 1 at a run start
            end[q] = int(a_ph and a != b)
            # y after b minus y after a: depth step of b, placeholder offsets, edges
            off_b = -1 if b == _EDGE else int(b_ph)
            off_a = -1 if a == _EDGE else int(a_ph)
            dep = 2 if b == _START else -2 if b == _END else 0
            step[q] = dep - off_b + off_a + (_BIG if a_ph and b == _TEXT else 0)
    # the left edge's offset (-1) starts every row at y = 2 * depth - 1
    return (
        torch.tensor(cls, dtype=torch.int64, device=dev),
        torch.tensor(start, dtype=torch.int8, device=dev),
        torch.tensor(end, dtype=torch.int8, device=dev),
        torch.tensor(step, dtype=torch.int64, device=dev),
        lo - 1,
        hi - lo + 2,
    )


def check(ids: torch.Tensor, luts: tuple, expected) -> tuple[int, list[torch.Tensor], torch.Tensor]:
    """``(runs, [scan min, scan max, (bad runs)], placeholder mask)`` for ``ids`` ``[b, s]``
    int64: the run count as a host int, the rest scalars for the caller's one read.
    ``expected``: none, or one :class:`~.verify.Expected` of items the host knows (one run
    each, token order); run r must have item r's key ``modality + 1 + 8 * length (+ 8 *
    (s + 2) * sample)``."""
    b, s = ids.shape
    lengths, samples, _ = expected[0].known if expected else ((), None, 0)
    cls_t, start_t, end_t, step_t, lo, top = luts
    # table lookups by index_select over flat indices (on CPU about 3x faster than take)
    cls = cls_t.index_select(0, ids.sub(lo).clamp_(0, top).view(-1)).view(b, s)
    # pair t = (class[t - 1], class[t]) for t in 0..s over the edge-padded row: pair s
    # closes the row (a run ending at the last token ends there; y there is 2 * depth)
    padded = torch.constant_pad_nd(cls, (1, 1), _EDGE)
    pair = torch.add(padded[:, 1:], padded[:, :-1], alpha=8).view(-1)  # [b * (s + 1)]
    steps = step_t.index_select(0, pair).view(b, s + 1)
    lohi = torch.aminmax(torch.cumsum(steps, 1))
    first = start_t.index_select(0, pair)  # int8: modality + 1 where a run starts
    # CPU only (see tables()): nonzero's size is known on the host without a device sync,
    # so the run count comes with the start positions
    ps = torch.nonzero(first).view(-1)
    runs = ps.shape[0]
    parts = [lohi.min, lohi.max]
    if lengths:
        pe = torch.nonzero(end_t.index_select(0, pair)).view(-1)  # a run's end + 1
        if runs == len(lengths) == pe.shape[0]:
            got = torch.add(first.index_select(0, ps), pe - ps, alpha=8)  # + 8 * length
            if samples is not None:  # the run's row
                got = torch.add(got, torch.floor_divide(ps, s + 1), alpha=8 * (s + 2))
            # a length past the row is capped at s + 1, which no run has: uncapped, 8 * n
            # could reach into the next row's keys (n = s + 3 in sample 0 reads as 1 in 1)
            smp = samples if samples is not None else [0] * len(lengths)
            code, row = expected[0].code + 1, 8 * (s + 2)
            want = [code + 8 * min(n, s + 1) + row * r for n, r in zip(lengths, smp)]
            parts.append(torch.count_nonzero(got != constant(tuple(want), ids.device)))
        else:  # runs and items disagree in number: the verdict fails on that already
            parts.append(torch.tensor(len(lengths)))
    return runs, parts, cls >= _PH
