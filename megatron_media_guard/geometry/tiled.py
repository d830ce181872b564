"""Fixed-size tiles: InternVL / NVLM / Nemotron-VL (``dynamic_preprocess``, its grid choice
and thumbnail: docs/GEOMETRY.md, "Fixed tiles"). Tokens per frame = tokens_per_tile *
(c*r + thumbnail)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_media_guard.geometry.solution import (
    Geometry,
    GeometryError,
    HwKind,
    Solution,
    check_frames,
    check_hw,
    check_positive,
    choice_text,
    divisor_pairs,
    unreachable,
)


@lru_cache(maxsize=256)
def _ratios(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(c, r) candidates in the source's visiting order (insertion order matters for ties)."""
    pairs = {
        (i, j)
        for n in range(min_tiles, max_tiles + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_tiles <= i * j <= max_tiles
    }
    return tuple(sorted(pairs, key=lambda cr: cr[0] * cr[1]))


@dataclass(frozen=True)
class TiledGeometry(Geometry):
    """InternVL-style tiling: tile side S in pixels, tokens of a tile after pixel shuffle,
    bounds on c*r, and an S x S thumbnail added when c*r != 1."""

    tile: int = 448
    tokens_per_tile: int = 256
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True

    def __post_init__(self) -> None:
        for name in ("tile", "tokens_per_tile", "min_tiles", "max_tiles"):
            check_positive(getattr(self, name), name)
        if self.min_tiles > self.max_tiles:
            raise GeometryError(f"min_tiles {self.min_tiles} > max_tiles {self.max_tiles}")

    def tiles_for(self, hw: tuple[int, int], *, max_tiles: int | None = None) -> tuple[int, int]:
        """(c, r) tile grid (cols, rows) the processor picks for an (H, W) image."""
        h, w = check_hw(hw)
        m = self.max_tiles if max_tiles is None else check_positive(max_tiles, "max_tiles")
        return self._pick(h, w, m)

    def _pick(self, h: int, w: int, max_tiles: int) -> tuple[int, int]:
        if max_tiles < self.min_tiles:
            raise GeometryError(f"max_tiles {max_tiles} < min_tiles {self.min_tiles}")
        aspect, area, s2 = w / h, w * h, self.tile * self.tile
        best, best_diff = (1, 1), float("inf")
        for c, r in _ratios(self.min_tiles, max_tiles):
            diff = abs(aspect - c / r)
            if diff < best_diff:
                best, best_diff = (c, r), diff
            elif diff == best_diff and area > 0.5 * s2 * c * r:
                best = (c, r)
        return best

    def size_for(
        self, hw: tuple[int, int], num_frames: int = 1, *, max_tiles: int | None = None
    ) -> tuple[int, int]:
        """Pixel (r*S, c*S) of the tiled canvas (the thumbnail is S x S besides)."""
        check_frames(num_frames)
        c, r = self.tiles_for(hw, max_tiles=max_tiles)
        return r * self.tile, c * self.tile

    def tokens(
        self, hw: tuple[int, int], num_frames: int = 1, *, max_tiles: int | None = None
    ) -> int:
        t = check_frames(num_frames)
        c, r = self.tiles_for(hw, max_tiles=max_tiles)
        return t * self.tokens_per_tile * (c * r + int(self.thumbnail and c * r != 1))

    def _solve(self, n_total: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        """Engine-replay where some max_tiles makes the processor pick a grid of the target's
        tiles for the source (``budget``: the smallest); else the grid of that many tiles
        closest in aspect (|W/H - c/r|) that the processor keeps as it is."""
        tpt, s = self.tokens_per_tile, self.tile
        if n_total % t:
            return unreachable(f"{n_total} is not divisible by {t} frames", t)
        per = n_total // t
        if per % tpt:
            return unreachable(f"{per} is not a multiple of {tpt} tokens per tile", t)
        n_tiles = per // tpt
        if self.thumbnail and n_tiles == 2:
            return unreachable(
                "2 tiles is unreachable with a thumbnail: 1 tile has none, 2+ tiles add one", t
            )
        k = n_tiles - 1 if self.thumbnail and n_tiles > 1 else n_tiles
        if not self.min_tiles <= k <= self.max_tiles:
            return unreachable(
                f"{n_tiles} tiles need a {k}-tile grid, outside [{self.min_tiles}, "
                f"{self.max_tiles}]",
                t,
            )

        def solution(cr: tuple[int, int], fidelity, reason: str, budget: int | None) -> Solution:
            size, thumb = (cr[1] * s, cr[0] * s), self.thumbnail and k != 1
            return Solution(
                n_total, size, fidelity, reason, None, cr, thumb, num_frames=t, budget=budget
            )

        replays = range(max(k, self.min_tiles), self.max_tiles + 1) if kind == "source" else ()
        for m in replays:
            cr = self._pick(h, w, m)
            if cr[0] * cr[1] == k:
                why = (
                    f"the processor with max_tiles={m} picks {cr[0]}x{cr[1]} tiles for "
                    f"{w}x{h} (W x H) -> {n_tiles} tiles"
                )
                return solution(cr, "engine-replay", why, m)
        # the grids the processor picks again for their own (r*S, c*S) canvas
        valid = [
            cr for cr in divisor_pairs(k) if self._pick(cr[1] * s, cr[0] * s, self.max_tiles) == cr
        ]
        if not valid:
            return unreachable(
                f"no {k}-tile grid is kept as it is by the processor (max_tiles {self.max_tiles})",
                t,
            )
        aspect = w / h
        best = min(valid, key=lambda cr: (abs(aspect - cr[0] / cr[1]), cr[1]))
        fidelity = "unique" if len(valid) == 1 else "closest-aspect"
        why = (
            f"no max_tiles in [{k}, {self.max_tiles}] picks a {k}-tile grid for {w}x{h} "
            f"(W x H); {choice_text(len(valid), best[0], best[1], f'of {k} tiles (c x r)')}"
        )
        return solution(best, fidelity, why, None)
