"""RADIO dynamic-resolution tiler (Nemotron Nano VL / Omni; vLLM DynamicResolutionImageTiler):
per image, under a budget of B patches, a (ph, pw) grid of patches, (ph/d) * (pw/d) tokens
(``radio_search.tile``; its formulas and quirks: docs/GEOMETRY.md, "RADIO dynamic-resolution
tiler"). The engine shares one budget among a request's media (``engine_tokens``); the
training processor knows only its static budget (``max_num_patches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_media_guard.geometry.radio_search import engine_budgets, landing_budgets, tile
from megatron_media_guard.geometry.solution import (
    Geometry,
    GeometryError,
    HwKind,
    Solution,
    check_frames,
    check_hw,
    check_positive,
    choice_text,
    divisors,
    groups,
    per_group,
    pick,
    unreachable,
)

_ENGINE_ROUNDS = 10  # the engine gives up after this many scale-down rounds


@dataclass(frozen=True)
class RadioEngineItem:
    """One media item of a request as the engine sized it: the last round's patch budget,
    (ph, pw) patches, (16*ph, 16*pw) pixels, (ph/2) * (pw/2) tokens per frame."""

    budget: int
    grid: tuple[int, int]
    size_hw: tuple[int, int]
    tokens: int


@dataclass(frozen=True)
class RadioTilerGeometry(Geometry):
    """RADIO tiler sizing: patch side in pixels, patches merged per side into a token, the
    per-item clamp (max None or 0: no cap), the training processor's static budget (None:
    max_num_patches), frames per token group, the engine's cap on the scale factor."""

    patch: int = 16
    pixel_shuffle: int = 2
    min_num_patches: int = 1024
    max_num_patches: int | None = 13312
    budget: int | None = None
    temporal_patch: int = 1
    factor_max: float = 1.0

    def __post_init__(self) -> None:
        for name in ("patch", "pixel_shuffle", "temporal_patch"):
            check_positive(getattr(self, name), name)
        check_positive(self.min_num_patches, "min_num_patches", allow_zero=True)
        if self.max_num_patches is not None:
            check_positive(self.max_num_patches, "max_num_patches", allow_zero=True)
        if self.budget is not None:
            check_positive(self.budget, "budget")
        if not self.factor_max > 0:
            raise GeometryError(f"factor_max must be > 0, got {self.factor_max}")

    @property
    def cap(self) -> int | None:
        return self.max_num_patches or None

    def native(self, hw: tuple[int, int]) -> tuple[int, int]:
        """(ph0, pw0): the patch grid the tiler starts from."""
        h, w = check_hw(hw)
        return round(h / self.patch + 0.5), round(w / self.patch + 0.5)

    def _grid(self, ph0: int, pw0: int, budget: int) -> tuple[int, int]:
        """The tiler's (ph, pw) at ``budget`` patches (the engine's float rounding)."""
        grid = tile(self, ph0, pw0, budget)
        if grid is None:
            raise GeometryError(
                f"the tiler divides by zero: {ph0}x{pw0} patches scale to an empty grid "
                f"at budget {budget}",
                context={"native": [ph0, pw0], "budget": budget},
            )
        return grid

    def grid_for(self, hw: tuple[int, int], budget: int | None = None) -> tuple[int, int]:
        """(ph, pw) patches for one frame at ``budget`` (None: the static budget)."""
        static = self.budget or engine_budgets(self)[1]
        b = static if budget is None else check_positive(budget, "budget")
        return self._grid(*self.native(hw), b)

    def size_for(
        self, hw: tuple[int, int], num_frames: int = 1, *, budget: int | None = None
    ) -> tuple[int, int]:
        check_frames(num_frames)
        ph, pw = self.grid_for(hw, budget)
        return ph * self.patch, pw * self.patch

    def tokens(self, hw: tuple[int, int], num_frames: int = 1, *, budget: int | None = None) -> int:
        t = check_frames(num_frames)
        ph, pw = self.grid_for(hw, budget)
        d = self.pixel_shuffle
        return groups(t, self.temporal_patch) * (ph // d) * (pw // d)

    def engine_tokens(
        self,
        sizes: Sequence[tuple[int, int]],
        max_model_len: int,
        prompt_text_len: int,
    ) -> tuple[RadioEngineItem, ...]:
        """Replays the engine's shared budget for the media of one request (in order)."""
        hws = [check_hw(hw) for hw in sizes]
        max_len = check_positive(max_model_len, "max_model_len")
        text = check_positive(prompt_text_len, "prompt_text_len", allow_zero=True)
        if not hws:
            return ()
        d2, mn, cap = self.pixel_shuffle**2, self.min_num_patches, self.cap
        total = max((max_len - text - 4) * d2, mn * len(hws))
        first = min(total, cap) if cap is not None else total
        budgets = [max(first, mn)] * len(hws)
        natives = [self.native(hw) for hw in hws]
        for _ in range(_ENGINE_ROUNDS):
            grids = [self._grid(ph0, pw0, b) for (ph0, pw0), b in zip(natives, budgets)]
            used = sum(ph * pw for ph, pw in grids)
            if used <= total:
                px, d = self.patch, self.pixel_shuffle
                return tuple(
                    RadioEngineItem(b, g, (g[0] * px, g[1] * px), (g[0] // d) * (g[1] // d))
                    for b, g in zip(budgets, grids)
                )
            scale = total / used
            scaled = [max(mn, int(ph * pw * scale)) for ph, pw in grids]
            shrunk = any(new < old for new, old in zip(scaled, budgets))
            budgets = scaled if shrunk else [mn] * len(hws)
        raise GeometryError(
            f"the engine's budget loop did not converge in {_ENGINE_ROUNDS} rounds for "
            f"{len(hws)} media in {max_len - text - 4} tokens",
            context={"sizes": [list(hw) for hw in hws], "max_model_len": max_len},
        )

    def _kept_grids(self, n: int) -> list[tuple[tuple[int, int], int]]:
        """Every (d*a, d*b) grid, a*b == n, that the tiler keeps at some engine budget, with
        one: its patch count clamped to the engine's budgets (an even grid is its own native
        grid, s exactly 1; min_num_patches itself skips the upscale), else its landings."""
        d, (lo, hi) = self.pixel_shuffle, engine_budgets(self)
        out = []
        for a in divisors(n):
            grid = (d * a, d * (n // a))
            # native() of its (16*ph, 16*pw) frame: h / patch == ph exactly, so round(ph + 0.5)
            own = round(grid[0] + 0.5), round(grid[1] + 0.5)
            b = min(max(d * d * n, lo), hi)
            if tile(self, *own, b) != grid:
                b = next((x for x, g in landing_budgets(self, *own, d * d * n) if g == grid), None)
            if b is not None:
                out.append((grid, b))
        return out

    def _pin_budget(self, ph0: int, pw0: int, grid: tuple[int, int], starts: list[int]) -> int:
        """A landing budget for a repair to pin: of the runs (``starts``, ascending) the first
        holding min_num_patches or a multiple of pixel_shuffle**2 (a one-image request's)."""
        m = self.pixel_shuffle**2
        for b in starts:
            c = b if b == self.min_num_patches else -(-b // m) * m
            if tile(self, ph0, pw0, c) == grid:
                return c
        return starts[0]

    def _solve(self, n_total: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        """From a source: the grids the tiler gives it with that count at some engine budget,
        one of them an engine-replay (``budget`` a landing, a multiple of pixel_shuffle**2
        where one is), several closest-aspect; from a frame (or a source never sized so):
        the grids of that count kept unchanged at some engine budget, closest in aspect."""
        d, px = self.pixel_shuffle, self.patch
        n = per_group(n_total, t, self.temporal_patch)
        if isinstance(n, Solution):
            return n
        q = n * d * d
        ph0, pw0 = self.native((h, w))

        def solution(grid, fidelity, reason, budget) -> Solution:
            size = (grid[0] * px, grid[1] * px)
            return Solution(n_total, size, fidelity, reason, grid, num_frames=t, budget=budget)

        lands = ""
        if kind == "source":
            landings = landing_budgets(self, ph0, pw0, q)  # (budget, grid), budget ascending
            if landings:
                grids = list(dict.fromkeys(gr for _, gr in landings))
                best, fidelity, count = pick(grids, (h, w), (px, px))
                b = self._pin_budget(ph0, pw0, best, [b for b, gr in landings if gr == best])
                fidelity = "engine-replay" if count == 1 else fidelity
                more = (
                    ""
                    if count == 1
                    else f"; {count} grids of {q} patches are the tiler's at some budget "
                    f"({', '.join(f'{a}x{c}' for a, c in grids)}): the count does not "
                    f"tell which the engine used, {best[0]}x{best[1]} is closest in aspect"
                )
                why = (
                    f"the tiler at a budget of {b} patches sizes {ph0}x{pw0} native patches "
                    f"to {best[0]}x{best[1]} = {n} tokens per group{more}"
                )
                return solution(best, fidelity, why, b)
            lands = (
                f"no budget in [{engine_budgets(self)[0]}, {self.cap}] makes the tiler give {n} "
                f"tokens for {ph0}x{pw0} native patches; "
            )
        valid = self._kept_grids(n) if q <= self._kept_bound() else []
        if not valid:
            if self.cap is not None and q > self.cap:
                why = f"{n} tokens need {q} patches, above max_num_patches {self.cap}"
            else:
                why = f"no grid of {q} patches is kept as it is by the tiler at any engine budget"
            return unreachable(lands + why, t)
        best, fidelity, count = pick([gr for gr, _ in valid], (h, w), (px, px))
        keep = dict(valid)[best]
        frame = "with only a processed frame's size, " if kind == "frame" else ""
        why = (
            f"{lands}{frame}{choice_text(count, best[0], best[1], f'of {q} patches')} "
            f"(grids the tiler keeps unchanged at some engine budget; this one at "
            f"{keep} patches)"
        )
        return solution(best, fidelity, why, keep)

    def _kept_bound(self) -> int:
        """No grid of more patches is kept at any engine budget B <= hi (floors hold at most B
        patches, the upscale at most 2 * min + 2, the evenness step at most d times that):
        huge targets skip the divisor scan."""
        d, (_, hi) = self.pixel_shuffle, engine_budgets(self)
        return d * max(hi, 2 * self.min_num_patches + 2) + d * d
