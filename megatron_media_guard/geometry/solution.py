"""The answer every geometry family gives (:class:`Solution`), the base they share, and their
input checks. Pure Python: no torch, no torch.distributed, no megatron.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from megatron_media_guard.config import Fidelity
from megatron_media_guard.errors import MediaInputError

FIDELITIES: tuple[Fidelity, ...] = ("engine-replay", "unique", "closest-aspect", "unreachable")
HwKind = Literal["source", "frame"]
HW_KINDS: tuple[HwKind, ...] = ("source", "frame")


class GeometryError(MediaInputError):
    """A geometry was given input it cannot size (bad size, count, frames or config)."""


@dataclass(frozen=True)
class Solution:
    """How to size one media item so that its encoder yields exactly ``tokens`` features (0,
    ``size_hw`` None: unreachable), and how sure the family is that this is the engine's
    sizing (``fidelity``); each field: docs/GEOMETRY.md, "Solution and fidelity"."""

    tokens: int
    size_hw: tuple[int, int] | None
    fidelity: Fidelity
    reason: str
    grid: tuple[int, int] | None
    tiles: tuple[int, int] | None = None
    thumbnail: bool = False
    num_frames: int = 1
    budget: int | None = None

    @property
    def reachable(self) -> bool:
        return self.fidelity != "unreachable"


class Geometry:
    """The base of every family: ``solve`` checks its arguments, the family's ``_solve`` answers
    (its docstring says how)."""

    def solve(
        self,
        target_tokens: int,
        hw: tuple[int, int],
        num_frames: int = 1,
        *,
        hw_kind: HwKind = "source",
    ) -> Solution:
        """A size of ``hw``'s media (``num_frames`` frames) that gives exactly
        ``target_tokens``, with its fidelity; ``hw_kind="frame"``: ``hw`` is a size the
        processor already resized, so no answer is called the engine's sizing."""
        n = _int(target_tokens, "target_tokens")
        if n < 0:
            raise GeometryError(
                f"target token count must be >= 0, got {n}", context={"target_tokens": n}
            )
        (h, w), t = check_hw(hw), check_frames(num_frames)
        if hw_kind not in HW_KINDS:
            raise GeometryError(
                f"hw_kind must be one of {list(HW_KINDS)} (the original media's size, or a "
                f"frame the training processor already resized), got {hw_kind!r}",
                context={"hw_kind": str(hw_kind)},
            )
        if n == 0:
            return unreachable(
                f"a {type(self).__name__} item yields at least one token; target is 0", t
            )
        return self._solve(n, h, w, t, hw_kind)

    def _solve(self, n: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        raise NotImplementedError


def unreachable(reason: str, num_frames: int = 1) -> Solution:
    return Solution(0, None, "unreachable", reason, None, num_frames=num_frames)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise GeometryError(f"{what} must be an integer, got {value!r}", context={what: str(value)})
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise GeometryError(
            f"{what} must be an integer, got {value!r} ({type(value).__name__})",
            context={what: str(value)},
        ) from None


def check_hw(hw: object) -> tuple[int, int]:
    """``hw`` as a pair of positive ints (H, W); GeometryError naming the value otherwise."""
    try:
        h, w = hw  # type: ignore[misc]
    except (TypeError, ValueError):
        raise GeometryError(
            f"media size must be a pair (H, W), got {hw!r}", context={"hw": str(hw)}
        ) from None
    h, w = _int(h, "height"), _int(w, "width")
    if h <= 0 or w <= 0:
        raise GeometryError(
            f"media size must be positive, got (H, W) = ({h}, {w})", context={"hw": [h, w]}
        )
    return h, w


def check_positive(value: object, what: str, *, allow_zero: bool = False) -> int:
    v = _int(value, what)
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise GeometryError(f"{what} must be {bound}, got {v}", context={what: v})
    return v


def check_frames(num_frames: object) -> int:
    return check_positive(num_frames, "num_frames")


def per_group(n_total: int, t: int, temporal_patch: int) -> int | Solution:
    """The count per temporal group of a ``t``-frame item, or why none (unreachable)."""
    g = groups(t, temporal_patch)
    if n_total % g:
        return unreachable(
            f"{n_total} is not divisible by the {g} temporal groups of {t} frames "
            f"(temporal_patch {temporal_patch})",
            t,
        )
    return n_total // g


def first_landing(
    lo: int, hi: int, n: int, cells: Callable[[int], tuple[int, int] | None]
) -> tuple[int, tuple[int, int]] | None:
    """The smallest budget in [lo, hi] whose cells (their product monotone in the budget;
    None: the processor rejects it) number at least n, with its cells, if they are exactly
    n; else None."""

    def reaches(m: int) -> bool:
        c = cells(m)
        return c is not None and c[0] * c[1] >= n

    if not reaches(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid + 1
    c = cells(lo)
    return (lo, c) if c is not None and c[0] * c[1] == n else None


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` >= 1, ascending (none for n < 1): trial division by the primes
    (O(sqrt of n's second-largest prime factor)), then the products."""
    if n < 1:
        return []
    out, m, p = [1], n, 2
    while p * p <= m:
        if m % p == 0:
            k = 0
            while m % p == 0:
                m //= p
                k += 1
            out = [x * p**e for x in out for e in range(k + 1)]
        p += 1 if p == 2 else 2
    if m > 1:
        out += [x * m for x in out]
    return sorted(out)


def divisor_pairs(n: int) -> Iterator[tuple[int, int]]:
    """Every (a, b) with a * b == n, a ascending."""
    for a in divisors(n):
        yield a, n // a


def groups(num_frames: int, temporal_patch: int) -> int:
    """Temporal groups a clip of ``num_frames`` frames yields (frames padded up to a multiple)."""
    return -(-num_frames // temporal_patch)


def choice_text(count: int, rows: int, cols: int, what: str) -> str:
    if count == 1:
        return f"only the grid {rows}x{cols} {what} fits"
    return f"{count} grids {what} fit, {rows}x{cols} is closest in aspect"


def pick(
    candidates: list[tuple[int, int]],
    hw: tuple[int, int],
    scale: tuple[int, int],
) -> tuple[tuple[int, int], Fidelity, int]:
    """The candidate (rows, cols) closest in aspect to ``hw`` (|log((r / c) / (H / W))|,
    compared exactly: a ratio and its reciprocal tie), then in area (rows*scale_h *
    cols*scale_w vs H*W), then fewest rows, then first listed; with its fidelity and the
    number of candidates."""
    h, w = hw
    area, cell = h * w, scale[0] * scale[1]
    best = min(
        (Fraction(max(r * w, c * h), min(r * w, c * h)), abs(r * c * cell - area), r, i)
        for i, (r, c) in enumerate(candidates)
    )
    fidelity: Fidelity = "unique" if len(candidates) == 1 else "closest-aspect"
    return candidates[best[3]], fidelity, len(candidates)
