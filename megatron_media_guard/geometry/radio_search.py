"""Budget search for the RADIO tiler: every per-item budget that lands on a patch count.

The grid depends on the budget B only through the floors of s*ph0 and s*pw0 (s = sqrt(B /
(ph0*pw0))), the upscale switch B > min_num_patches and the evenness tests (ph+1)*pw <= B:
the walk visits the segments of constant floors in the windows that can hold the target and
runs the tiler at segment starts and thresholds only. The count is not monotone in B (an
evenness step can trade rows for columns), so no bisection; the windows and the skips:
docs/GEOMETRY.md.
"""

from __future__ import annotations

import math
from typing import Protocol

from megatron_media_guard.geometry.solution import divisors

_INF = 1 << 62


class TilerView(Protocol):
    """What the search reads of the tiler (``radio.RadioTilerGeometry``, which imports this
    module: so it is described here, not imported)."""

    pixel_shuffle: int
    min_num_patches: int
    factor_max: float

    @property
    def cap(self) -> int | None: ...


def engine_budgets(geo: TilerView) -> tuple[int, int]:
    """[lo, hi]: every per-item budget the engine can give (``engine_tokens``)."""
    return max(geo.min_num_patches, 1), geo.cap if geo.cap is not None else _INF


def _budget_at(geo: TilerView, s: float, p: int) -> int:
    """A budget past which the scale factor exceeds ``s`` (unbounded at the factor cap)."""
    return _INF if s >= geo.factor_max else math.ceil(s * s * p) + 2


def windows(geo: TilerView, ph0: int, pw0: int, q: int) -> list[tuple[int, int]]:
    """Budget ranges that can give q patches, ascending: the plain regime and the upscale
    regime, one range where they overlap (each budget walked once)."""
    p, ssum, mn, d = ph0 * pw0, ph0 + pw0, geo.min_num_patches, geo.pixel_shuffle
    k = d - 1  # the evenness step moves a side by at most d - 1
    s_lo = (
        (-k * ssum + math.sqrt(k * k * ssum * ssum + 4 * p * (q - k * k))) / (2 * p)
        if q > k * k
        else 0.0
    )
    a, b = min(ph0, pw0), max(ph0, pw0)
    if d * (2 * d * b / a - d) <= q:  # past s = 2d/a both factors exceed d
        s_hi = (d * ssum + math.sqrt(d * d * ssum * ssum + 4 * p * (q - d * d))) / (2 * p)
    else:
        s_hi = (q / d + d) / b
    out = [(int(s_lo * s_lo * p) - 2, _budget_at(geo, s_hi, p))]
    if mn > 0:
        s_up = (ssum + math.sqrt(ssum * ssum + 4 * p * (mn - 1))) / (2 * p)
        out = sorted([*out, (mn + 1, _budget_at(geo, s_up, p))])
        if out[1][0] <= out[0][1] + 1:
            out = [(out[0][0], max(out[0][1], out[1][1]))]
    return out


def _prepare(geo: TilerView, ph0: int, pw0: int, budget: int):
    """(fh, fw, h, w): the tiler's floors and its grid before the evenness step, in the
    engine's float arithmetic; None where it divides by zero."""
    mn = geo.min_num_patches
    s = min(math.sqrt(budget / (ph0 * pw0)), geo.factor_max)
    fh, fw = math.floor(s * ph0), math.floor(s * pw0)
    h, w = fh, fw
    if budget > mn and fh * fw < mn:
        if fh * fw == 0:
            return None
        u = math.sqrt(mn / (fh * fw))
        h, w = math.ceil(u * fh), math.ceil(u * fw)
    return fh, fw, h, w


def tile(geo: TilerView, ph0: int, pw0: int, budget: int) -> tuple[int, int] | None:
    """The tiler's (ph, pw) for ph0 x pw0 native patches at ``budget`` (docs/GEOMETRY.md);
    None where it divides by zero."""
    prep = _prepare(geo, ph0, pw0, budget)
    if prep is None:
        return None
    d, ph, pw = geo.pixel_shuffle, prep[2], prep[3]
    if r := ph % d:
        ph = ph + d - r if (ph + d - r) * pw <= budget else max(d, ph - r)
    if r := pw % d:
        pw = pw + d - r if ph * (pw + d - r) <= budget else max(d, pw - r)
    return ph, pw


def _even_options(v: int, d: int) -> tuple[int, ...]:
    """Where the evenness step can take a side of v (up, or down with a floor of d)."""
    r = v % d
    return (v,) if r == 0 else (v + d - r, max(d, v - r))


def landing_budgets(
    geo: TilerView, ph0: int, pw0: int, q: int
) -> list[tuple[int, tuple[int, int]]]:
    """(budget, grid) pairs in [min, cap] where the tiler's grid has q patches, budget
    ascending; at least the first budget of every segment and threshold run that lands."""
    d, mn = geo.pixel_shuffle, geo.min_num_patches
    n, k = divmod(q, d * d)
    if k or not n:  # the evenness step leaves both sides multiples of d
        return []
    lo_all, hi_all = engine_budgets(geo)
    if q > d * (2 * mn + 2) + d * d:  # past what the upscale reaches: the budget must hold it
        lo_all = max(lo_all, -(-(q - d * d) // d))  # (see RadioTilerGeometry._kept_bound)
    p = ph0 * pw0
    fmax2 = geo.factor_max * geo.factor_max
    hits: set[tuple[int, tuple[int, int]]] = set()
    # the final grids a x (q / a), both sides multiples of d: per side a, the range of the
    # other side's pre-evenness values that the evenness step takes to q / a
    sides = {}
    for a in divisors(n):
        b = d * (n // a)
        sides[d * a] = (0 if b == d else b - d + 1, b + d - 1)
    for lo, hi in windows(geo, ph0, pw0, q):
        x, hi = max(lo, lo_all), min(hi, hi_all)
        while x <= hi:
            prep = _prepare(geo, ph0, pw0, x)
            fh, fw = (prep[0], prep[1]) if prep else (0, 0)
            ends = [hi + 1]  # the next budget where a floor or the upscale switch can change
            if fh * fh < fmax2 * ph0 * ph0 or fw * fw < fmax2 * pw0 * pw0:
                ends += [-(-((fh + 1) ** 2) * p // ph0**2), -(-((fw + 1) ** 2) * p // pw0**2)]
            if x <= mn:
                ends.append(mn + 1)
            end = max(x + 1, min(ends))
            if prep is not None:
                hs, ws = _even_options(prep[2], d), _even_options(prep[3], d)
                if any(a * b == q for a in hs for b in ws):
                    # x +- 1 absorb float rounding at the segment edges
                    points = {x - 1, x, x + 1} | {a * c for a in hs for c in (*ws, prep[3])}
                    for b in points:
                        if max(x - 1, lo_all) <= b < end and b <= hi:
                            g = tile(geo, ph0, pw0, b)
                            if g is not None and g[0] * g[1] == q:
                                hits.add((b, g))
            up = x > mn and fh * fw < mn
            skip = max(
                _bound_along(geo, sides, x, fh, fw, ph0, pw0, up),
                _bound_along(geo, sides, x, fw, fh, pw0, ph0, up),
            )
            x = max(end, skip)
    return sorted(hits)


def _floor_start(v: int, n0: int, p: int) -> int:
    """A budget at or below the first one where floor(s * n0) reaches v (s = sqrt(B / p))."""
    return v * v * p // (n0 * n0) - 2


def _bound_along(
    geo: TilerView,
    sides: dict[int, tuple[int, int]],
    x: int,
    fa: int,
    fb: int,
    na: int,
    nb: int,
    up: bool,
) -> int:
    """A budget before which nothing from ``x`` on lands: floor ``fa`` (of ``na`` native
    patches) held until it next changes, ``fb`` only grows meanwhile, and landings need fb in
    a few narrow ranges. Keeps the walk's length independent of the aspect ratio."""
    d, mn, p = geo.pixel_shuffle, geo.min_num_patches, na * nb
    grows = fa * fa < geo.factor_max * geo.factor_max * na * na
    ea = -(-((fa + 1) ** 2) * p // na**2) if grows else _INF  # where fa changes
    if fa == 0:  # an empty side: no patches (budget <= min) or the tiler fails (above)
        return ea
    if fb == 0:
        return x
    nxt = _INF
    if not up:  # plain: fa's evenness options fix the other side
        limit = ea if x > mn else min(ea, mn + 1)
        for a in _even_options(fa, d):
            r = sides.get(a)
            if r is not None and r[1] >= fb:
                nxt = min(nxt, r[0])
    else:  # upscale: fb's side ceil(sqrt(mn * fb / fa)) grows, fa's shrinks from a_max
        limit = min(ea, _floor_start(-(-mn // fa), nb, p))
        a_max = max(_even_options(math.ceil(math.sqrt(mn / (fa * fb)) * fa), d))
        for a, (lo, hi) in sides.items():
            # that side in [lo - 1, hi + 1] (one of slack for float rounding)
            if a <= a_max and ((hi + 1) ** 2 * fa) // mn + 1 >= fb:
                nxt = min(nxt, (max(lo - 2, 0) ** 2 * fa) // mn)
    if nxt == _INF:
        return limit
    return x if nxt <= fb else min(limit, _floor_start(nxt, nb, p))
