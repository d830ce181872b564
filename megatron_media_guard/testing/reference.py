"""The straightforward per-token reference parser: the oracle the vectorized parser is
checked and timed against. Tests and benchmarks only; the runtime never imports it."""

from __future__ import annotations

import torch

from ..core.grammar import Grammar


def reference_runs(ids: torch.Tensor, grammar: Grammar) -> list[tuple[int, int, int, int, str]]:
    """Per-token Python loop: (sample, start, end, placeholders, modality) for each run.

    The straightforward implementation the vectorized parser is checked and timed against
    (it needs the ids on the host as lists first).
    """
    rows = ids.tolist()
    ph = {v: k for k, v in grammar.placeholders.items()}
    brk = set(grammar.break_ids)
    out = []
    for b, row in enumerate(rows):
        cur = None
        for i, t in enumerate(row):
            content = t in ph or t in brk
            if cur is not None and t in ph and row[i - 1] in ph and ph[row[i - 1]] != ph[t]:
                out.append(tuple(cur))
                cur = None
            if content:
                if cur is None:
                    cur = [b, i, i + 1, 0, None]
                cur[2] = i + 1
                if t in ph:
                    cur[3] += 1
                    if cur[4] is None:
                        cur[4] = ph[t]
            elif cur is not None:
                out.append(tuple(cur))
                cur = None
        if cur is not None:
            out.append(tuple(cur))
    return [(s, a, e, n, m or "break") for s, a, e, n, m in out]
