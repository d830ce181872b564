"""LLaVA-OneVision anyres sizing (transformers ``LlavaOnevisionImageProcessor`` and
``LlavaOnevisionModel.pack_image_features``), for an image that is its sample's only one:

    (bh, bw) = select_best_resolution((H, W), pinpoints)     (most kept area, then least waste)
    cur = (side * bh / T, side * bw / T)                       (T = tile px, side = T // patch)
    unpad: the side the image does not fill loses 2 * ((cur - round(H or W scaled)) // 2) rows
    anyres_max_k: if sqrt(cur_h * cur_w / (k * side^2)) > 1.1, both sides divided by it
    tokens = side^2 (the base tile) + cur_h * (cur_w + 1)     (one newline feature per row)

The count depends on the chosen pinpoint and the aspect, not on the pixels. ``solve`` keeps
the image's own size where it gives the target (engine-replay), else picks the size closest
in aspect, then area, that does (closest-aspect) of the image's own aspect on ``patch``-pixel
steps and a lattice holding every count some image gives. An image of a multi-image sample
is one tile, base + 1 whatever its size: no geometry changes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from megatron_media_guard.geometry.solution import (
    Geometry,
    GeometryError,
    HwKind,
    Solution,
    check_frames,
    check_hw,
    check_positive,
    pick,
    unreachable,
)


def best_resolution(h: int, w: int, pinpoints) -> tuple[int, int]:
    """transformers' ``select_best_resolution((h, w), pinpoints)``: ties go to the first."""
    best, best_eff, best_waste = (0, 0), 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        eff = min(int(w * scale) * int(h * scale), w * h)
        waste = pw * ph - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    return best


def fitted_size(h: int, w: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' ``get_patch_output_size``: the image resized into ``target`` (aspect
    kept, the tighter side filled), before the centred zero padding to ``target``."""
    th, tw = target
    if tw / w < th / h:
        return min(math.ceil(h * tw / w), th), tw
    return th, min(math.ceil(w * th / h), tw)


@dataclass(frozen=True)
class AnyresGeometry(Geometry):
    """Anyres sizing. pinpoints: ``config.image_grid_pinpoints`` ((H, W) pixels, multiples of
    ``tile``); tile / patch: ``vision_config.image_size`` / ``.patch_size``; max_tiles: the k
    of ``config.vision_aspect_ratio = "anyres_max_k"``."""

    pinpoints: tuple[tuple[int, int], ...]
    tile: int = 384
    patch: int = 14
    max_tiles: int = 9

    def __post_init__(self) -> None:
        object.__setattr__(self, "pinpoints", tuple((int(h), int(w)) for h, w in self.pinpoints))
        for name in ("tile", "patch", "max_tiles"):
            check_positive(getattr(self, name), name)
        bad = [p for p in self.pinpoints if min(p) < 1 or p[0] % self.tile or p[1] % self.tile]
        if not self.pinpoints or bad:
            raise GeometryError(f"pinpoints must be positive multiples of {self.tile}: {bad}")

    @property
    def side(self) -> int:
        return self.tile // self.patch

    def size_for(self, hw: tuple[int, int], num_frames: int = 1) -> tuple[int, int]:
        """The pinpoint (H, W) the processor pads the image to (its tiles' canvas)."""
        h, w = check_hw(hw)
        check_frames(num_frames)
        return best_resolution(h, w, self.pinpoints)

    def feature_grid(self, hw: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of the unpadded, capped feature map (before the newline column)."""
        h, w = check_hw(hw)
        bh, bw = best_resolution(h, w, self.pinpoints)
        ch, cw = self.side * (bh // self.tile), self.side * (bw // self.tile)
        if w / h > cw / ch:
            ch -= 2 * ((ch - int(round(h * (cw / w), 7))) // 2)
        else:
            cw -= 2 * ((cw - int(round(w * (ch / h), 7))) // 2)
        ratio = math.sqrt(ch * cw / (self.max_tiles * self.side**2))
        if ratio > 1.1:
            ch, cw = int(ch // ratio), int(cw // ratio)
        return ch, cw

    def tokens(self, hw: tuple[int, int], num_frames: int = 1) -> int:
        """The image's features: base tile + rows * (cols + 1)."""
        check_frames(num_frames)
        ch, cw = self.feature_grid(hw)
        return self.side**2 + ch * (cw + 1)

    @cached_property
    def _lattice(self) -> dict[int, list[tuple[int, int]]]:
        """Count -> sizes giving it: every size on ``patch``-pixel steps up to the largest
        pinpoint side, and the sizes filling one side of a pinpoint with the other at each
        unpad step (±1 px), which the steps can miss (a 14x337 image's count was)."""
        top = max(max(p) for p in self.pinpoints) // self.patch
        sizes = {
            (i * self.patch, j * self.patch) for i in range(1, top + 1) for j in range(1, top + 1)
        }
        for bh, bw in self.pinpoints:
            ch, cw = self.side * bh // self.tile, self.side * bw // self.tile
            for k in range(ch + 1):  # wider than the pinpoint: k rows kept of ch
                sizes |= {(h, bw) for d in (-1, 0, 1) if 1 <= (h := round(k * bw / cw) + d) <= bh}
            for k in range(cw + 1):  # taller: k columns kept of cw
                sizes |= {(bh, w) for d in (-1, 0, 1) if 1 <= (w := round(k * bh / ch) + d) <= bw}
        out: dict[int, list[tuple[int, int]]] = {}
        for hw in sorted(sizes):
            out.setdefault(self.tokens(hw), []).append(hw)
        return out

    def _candidates(self, n: int, h: int, w: int) -> list[tuple[int, int]]:
        top = max(max(p) for p in self.pinpoints)
        own = {(a, round(a * w / h)) for a in range(self.patch, top + 1, self.patch)}
        own |= {(round(b * h / w), b) for b in range(self.patch, top + 1, self.patch)}
        found = [hw for hw in sorted(own) if min(hw) >= 1 and self.tokens(hw) == n]
        return found + [hw for hw in self._lattice.get(n, ()) if hw not in own]

    def _solve(self, n: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        """The image's own size where it gives the target, else the closest in aspect of the
        candidate sizes that do (see the module)."""

        def solution(size: tuple[int, int], fidelity, reason: str) -> Solution:
            bh, bw = best_resolution(*size, self.pinpoints)
            tiles = (bw // self.tile, bh // self.tile)
            grid = self.feature_grid(size)
            return Solution(n, size, fidelity, reason, grid, tiles=tiles, thumbnail=True)

        if kind == "source" and self.tokens((h, w)) == n:
            return solution((h, w), "engine-replay", f"the anyres count of {h}x{w} is {n}")
        found = self._candidates(n, h, w) if n >= self.side**2 else []
        if not found:
            return unreachable(
                f"no image size (on {self.patch}-px steps up to the largest pinpoint) has an "
                f"anyres count of {n} (base {self.side**2} + rows * (cols + 1))"
            )
        size, _, count = pick(found, (h, w), (1, 1))
        ch, cw = self.feature_grid(size)
        why = (
            f"{count} image sizes give {n} anyres features for {h}x{w}; {size[0]}x{size[1]} "
            f"({ch}x{cw} features, pinpoint {best_resolution(*size, self.pinpoints)}) is "
            "closest in aspect"
        )
        return solution(size, "closest-aspect", why)
