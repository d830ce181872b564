"""Pixtral / Mistral 3 sizing (transformers ``PixtralImageProcessor``'s
``get_resize_output_image_size``, with ``patch_size = patch * spatial_merge_size``):

    ratio = max(H / L, W / L)        (L = size["longest_edge"])
    if ratio > 1: H, W = floor(H / ratio), floor(W / ratio)
    H' = ceil(H / f) * f, W' likewise  (f = patch * merge = 28; small images grow)

Tokens = (H'/f) * (W'/f) features (the ids add one ``[IMG_BREAK]`` / ``[IMG_END]`` per row,
which take none). Each side is monotone in L, so for a target the longest edge that gives it
(the engine's, replayed) is found by bisection, and its grid is the only one any L gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    first_landing,
    pick,
    unreachable,
)


@dataclass(frozen=True)
class PixtralGeometry(Geometry):
    """Pixtral sizing. longest_edge: the processor's ``size["longest_edge"]`` and the tower's
    limit (``vision_config.image_size``: its rope table has image_size / patch positions per
    side); patch / merge: ``vision_config.patch_size`` and ``spatial_merge_size``."""

    longest_edge: int = 1540
    patch: int = 14
    merge: int = 2

    def __post_init__(self) -> None:
        for name in ("longest_edge", "patch", "merge"):
            check_positive(getattr(self, name), name)

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def _cells(self, h: int, w: int, edge: int) -> tuple[int, int]:
        ratio = max(h / edge, w / edge)
        if ratio > 1:
            h, w = math.floor(h / ratio), math.floor(w / ratio)
        f = self.factor
        return (h - 1) // f + 1, (w - 1) // f + 1

    def size_for(self, hw: tuple[int, int], num_frames: int = 1, *, longest_edge=None):
        """Pixel (H', W') the processor resizes to (``longest_edge`` overridable)."""
        h, w = check_hw(hw)
        check_frames(num_frames)
        edge = self.longest_edge if longest_edge is None else check_positive(longest_edge, "edge")
        a, b = self._cells(h, w, edge)
        if not a or not b:  # the processor fails on it too (a side of 0 pixels)
            raise GeometryError(f"the Pixtral resize of {h}x{w} to longest edge {edge} is empty")
        return a * self.factor, b * self.factor

    def tokens(self, hw: tuple[int, int], num_frames: int = 1, *, longest_edge=None) -> int:
        """(H'/f) * (W'/f): the image's features (its ``[IMG]`` placeholders)."""
        hb, wb = self.size_for(hw, num_frames, longest_edge=longest_edge)
        return (hb // self.factor) * (wb // self.factor)

    def _solve(self, n: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        """Engine-replay at the smallest longest edge giving the target (see the module); else
        the grid of that many cells closest in aspect that the tower takes."""
        f = self.factor
        top = self.longest_edge // f  # merged cells per side the tower takes

        def solution(a: int, b: int, fidelity, reason: str, budget: int | None) -> Solution:
            grid = (a * self.merge, b * self.merge)
            return Solution(n, (a * f, b * f), fidelity, reason, grid, budget=budget)

        # from max(H, W) on the image is only rounded up: the plateau
        replay = None
        if kind == "source":
            replay = first_landing(1, max(h, w), n, lambda edge: self._cells(h, w, edge))
        if replay is not None and max(replay[1]) <= top:
            edge, (a, b) = replay
            why = f"the Pixtral resize of {h}x{w} with longest_edge={edge} gives {a}x{b} cells"
            return solution(a, b, "engine-replay", why, edge)
        fits = n <= top * top  # (else no divisor scan: the tower takes no such grid)
        valid = [(a, b) for a, b in divisor_pairs(n) if a <= top and b <= top] if fits else []
        if not valid:
            return unreachable(
                f"no grid a*b = {n} has both sides <= {top} cells (longest edge "
                f"{self.longest_edge} px, {f} px per cell)"
            )
        (a, b), fidelity, count = pick(valid, (h, w), (f, f))
        why = (
            f"no longest edge makes the Pixtral resize give {n} cells for {h}x{w}; "
            f"{choice_text(count, a, b, f'of {n} cells')} (aspect)"
        )
        return solution(a, b, fidelity, why, None)
