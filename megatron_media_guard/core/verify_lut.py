"""The aligned-path check for marker grammars (Qwen-VL, InternVL) in a few fused ops.

Same verdict as the general check in ``verify.py`` for a grammar with start and end
markers, no break tokens, at most four placeholder modalities and unpacked rows, in about
a third of the torch ops (at short micro-batches the cost is op dispatch, not work):

- each token gets a class (text, start, end, placeholder of modality m) from one small
  lookup table indexed by ``ids - lowest special id`` (clamped);
- each pair of neighbours ``(class[t - 1], class[t])`` (rows padded with an edge class)
  becomes one index into per-pair tables: run start, run end, and the step of a scan;
- the scan ``y = cumsum(step)`` is twice the region depth minus the placeholder flag,
  shifted so that a well-formed row keeps ``y`` in {-1, 0, 1}: outside a region 2d - 1,
  on a placeholder 2d - 2, after the row's last token 2d; a placeholder followed by text
  (an unterminated run) adds a constant larger than any depth, which pushes the rest of
  the row out of range. So the structure is sound iff ``aminmax(y)`` lies in [-1, 1];
- run ``r`` is checked against item ``r`` through its start and end positions
  (``nonzero_static`` sized by the item count: runs and items agree in number on the
  aligned path, else the verdict fails on the run count anyway).
"""

from __future__ import annotations

import torch

from .grammar import Grammar

_EDGE = 7  # the class of the padding before a row's first token
_TEXT, _START, _END, _PH = 0, 1, 2, 3  # placeholder of modality m: class 3 + m

_TABLES: dict[tuple, tuple] = {}


def tables(grammar: Grammar, packed: bool, s: int, dev: torch.device) -> tuple | None:
    """The lookup tables for :func:`check` (per grammar, row length and device, cached), or
    None where the general check decides: packed rows, breaks, no markers, more than four
    modalities, special ids spread too far for a table, or off CPU (``nonzero_static`` is
    not on every accelerator in every release)."""
    key = (id(grammar), packed, s, dev)
    got = _TABLES.get(key)
    if got is not None and got[0] is grammar:
        return got[1]
    if len(_TABLES) >= 16:
        _TABLES.pop(next(iter(_TABLES)))
    ok = (
        dev.type == "cpu"
        and not packed
        and grammar.start_id is not None
        and grammar.end_id is not None
        and not grammar.break_ids
        and not grammar.collapsed
        and len(grammar.placeholders) <= 4
    )
    if ok:
        ok = max(_ids(grammar)) - min(_ids(grammar)) <= 1 << 16
    made = _build(grammar, s, dev) if ok else None
    _TABLES[key] = (grammar, made)
    return made


def _ids(grammar: Grammar) -> list[int]:
    return [grammar.start_id, grammar.end_id, *grammar.placeholders.values()]


def _build(grammar: Grammar, s: int, dev: torch.device) -> tuple:
    """The class table and the three pair tables."""
    ids = {grammar.start_id: _START, grammar.end_id: _END}
    ids.update({tok: _PH + m for m, tok in enumerate(grammar.placeholders.values())})
    lo, hi = min(ids), max(ids)
    cls = [_TEXT] * (hi - lo + 3)  # index 0: below lo, hi - lo + 2: above hi
    for tok, c in ids.items():
        cls[tok - lo + 1] = c
    big = 4 * s + 8  # more than any |2 * depth| + 2 in a row of s tokens
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
            step[q] = dep - off_b + off_a + (big if a_ph and b == _TEXT else 0)
    # the left edge's offset (-1) starts every row at y = 2 * depth - 1
    got = (
        torch.tensor(cls, dtype=torch.int64, device=dev),
        torch.tensor(start, dtype=torch.int8, device=dev),
        torch.tensor(end, dtype=torch.int8, device=dev),
        torch.tensor(step, dtype=torch.int64, device=dev),
        lo - 1,
        hi - lo + 2,
    )
    return got


def findings(lo: int, hi: int, tail: int) -> int:
    """Structure violations (as a 0/1 count per kind) from the scan's host values."""
    return int(lo < -1) + int(hi > 1) + int(tail > -1)


def check(
    ids: torch.Tensor, luts: tuple, want: torch.Tensor | None, n_items: int, explicit: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Device scalars ``[runs, scan min, scan max, scan max at row ends, bad runs]`` (sound
    structure: min >= -1, max <= 1, max at row ends <= -1: see :func:`findings`) and the ``[b, s]``
    placeholder mask. ``want``: ``[n_items]`` int64 keys of the expected items in token
    order, ``(modality + 1) + 8 * (length + b * s) (+ 8 * (s + 2) * sample when explicit)``."""
    s = ids.shape[1]
    cls_t, start_t, end_t, step_t, lo, top = luts
    idx = ids.sub(lo) if ids.dtype == torch.int64 else ids.to(torch.int64).sub_(lo)
    cls = torch.take(cls_t, idx.clamp_(0, top))
    # pair t = (class[t - 1], class[t]); no pair after the last token: a row ending inside
    # a region (or on a placeholder) shows as y != -1 there instead
    pair = torch.add(cls, torch.constant_pad_nd(cls[:, :-1], (1, 0), _EDGE), alpha=8)
    y = torch.cumsum(torch.take(step_t, pair), 1)
    lohi = torch.aminmax(y)
    first = torch.take(start_t, pair)  # int8: modality + 1 where a run starts, else 0
    parts = [torch.count_nonzero(first), lohi.min, lohi.max, y[:, -1].amax()]
    if n_items:
        # starts, then ends (pair t marks the end of token t - 1), in one flat tensor: one
        # nonzero_static gives run r's start at r and its end, offset by b * s, at n + r
        marks = torch.stack([first, torch.take(end_t, pair)]).view(-1)
        pos = torch.nonzero_static(marks, size=2 * n_items, fill_value=0).squeeze(1)
        ps, pe = pos[:n_items], pos[n_items:]
        got = torch.add(torch.take(marks, ps), pe - ps, alpha=8)  # + 8 * (length + b * s)
        if explicit:  # the run's row
            got = torch.add(got, ps // s, alpha=8 * (s + 2))
        parts.append(torch.count_nonzero(got != want))
    return parts, cls >= _PH
