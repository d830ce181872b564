"""Patch-merge dynamic resolution: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (transformers ``smart_resize``,
5.x, in ``_resize``; its formulas, Qwen3-VL video's shared budget and the solve:
docs/GEOMETRY.md, "Patch-merge dynamic resolution")."""

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
    groups,
    per_group,
    pick,
    unreachable,
)

_NO_CAP = 1 << 62


@dataclass(frozen=True)
class PatchMergeGeometry(Geometry):
    """Qwen-style patch-merge sizing (defaults: the HF Qwen2-VL image processor's): patch side
    and spatial merge (f = patch * merge), frames per temporal group, the pixel budget, the
    largest aspect the processor takes, Qwen3-VL's video rule (frames share the budget), and
    the fewest frames an item is sized as (GLM-4V sizes an image as a clip of 2)."""

    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_aspect: float = 200.0
    temporal_budget: bool = False
    min_frames: int = 1

    def __post_init__(self) -> None:
        for name in ("patch", "merge", "temporal_patch", "min_pixels", "max_pixels", "min_frames"):
            check_positive(getattr(self, name), name)
        if self.min_pixels > self.max_pixels:
            raise GeometryError(
                f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}",
                context={"min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
            )
        if not self.max_aspect >= 1:
            raise GeometryError(f"max_aspect must be >= 1, got {self.max_aspect}")

    @classmethod
    def qwen2_vl(cls, **overrides: object) -> PatchMergeGeometry:
        """Qwen2-VL checkpoints' preprocessor_config: 4..16384 tokens per image."""
        return cls(**{"min_pixels": 3136, "max_pixels": 12845056, **overrides})

    @classmethod
    def qwen2_5_vl(cls, **overrides: object) -> PatchMergeGeometry:
        """Qwen2.5-VL checkpoints' preprocessor_config (same sizing as Qwen2-VL)."""
        return cls.qwen2_vl(**overrides)

    @classmethod
    def qwen3_vl(cls, **overrides: object) -> PatchMergeGeometry:
        """Qwen3-VL checkpoints' image preprocessor: patch 16, 64..16384 tokens per image."""
        return cls(**{"patch": 16, "min_pixels": 65536, "max_pixels": 16777216, **overrides})

    @classmethod
    def qwen3_vl_video(cls, **overrides: object) -> PatchMergeGeometry:
        """Qwen3-VL checkpoints' video preprocessor: the frames share the pixel budget."""
        return cls.qwen3_vl(
            **{"min_pixels": 4096, "max_pixels": 25165824, "temporal_budget": True, **overrides}
        )

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def _frames(self, t: int) -> tuple[int, int]:
        """(frames, frames rounded to temporal groups) weighing the budget: Qwen3-VL video's."""
        if not self.temporal_budget:
            return 1, 1
        return t, round(t / self.temporal_patch) * self.temporal_patch

    def _resize(self, h: int, w: int, t: int, min_px: int, max_px: int) -> tuple[int, int]:
        """The processor's resize (H', W'); GeometryError where the processor raises."""
        f = self.factor
        if self.temporal_budget:
            if t < self.temporal_patch:
                raise GeometryError(
                    f"a clip of {t} frame(s) is shorter than temporal_patch "
                    f"{self.temporal_patch} (the video processor rejects it)",
                    context={"num_frames": t},
                )
            if h < f or w < f:
                scale = max(f / h, f / w)
                h, w = int(h * scale), int(w * scale)
        frames, t_bar = self._frames(t)
        if max(h, w) / min(h, w) > self.max_aspect:
            raise GeometryError(
                f"aspect ratio {max(h, w) / min(h, w):.4g} of (H, W) = ({h}, {w}) exceeds "
                f"{self.max_aspect:g} (the processor rejects it)",
                context={"hw": [h, w]},
            )
        hb, wb = round(h / f) * f, round(w / f) * f
        if t_bar * hb * wb > max_px:
            beta = math.sqrt(frames * h * w / max_px)
            hb = max(f, math.floor(h / beta / f) * f)
            wb = max(f, math.floor(w / beta / f) * f)
        elif t_bar * hb * wb < min_px:
            beta = math.sqrt(min_px / (frames * h * w))
            hb = math.ceil(h * beta / f) * f
            wb = math.ceil(w * beta / f) * f
        return hb, wb  # each >= f: a side rounded to 0 leaves 0 pixels, below min_pixels

    def size_for(
        self,
        hw: tuple[int, int],
        num_frames: int = 1,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> tuple[int, int]:
        """Pixel (H', W') the processor resizes to (budget overridable)."""
        h, w = check_hw(hw)
        t = max(check_frames(num_frames), self.min_frames)
        lo = self.min_pixels if min_pixels is None else check_positive(min_pixels, "min_pixels")
        hi = self.max_pixels if max_pixels is None else check_positive(max_pixels, "max_pixels")
        return self._resize(h, w, t, lo, hi)

    def tokens(
        self,
        hw: tuple[int, int],
        num_frames: int = 1,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> int:
        hb, wb = self.size_for(hw, num_frames, min_pixels=min_pixels, max_pixels=max_pixels)
        f, t = self.factor, max(num_frames, self.min_frames)
        return groups(t, self.temporal_patch) * (hb // f) * (wb // f)

    def _cells(self, h: int, w: int, t: int, min_px: int, max_px: int) -> tuple[int, int] | None:
        try:
            hb, wb = self._resize(h, w, t, min_px, max_px)
        except GeometryError:
            return None
        return hb // self.factor, wb // self.factor

    def _replay(self, h: int, w: int, t: int, n: int) -> tuple[str, int, tuple[int, int]] | None:
        """A budget with which the processor's own resize gives n cells per group."""
        f, (frames, t_bar) = self.factor, self._frames(t)
        nat = self._cells(h, w, t, 1, _NO_CAP)
        if nat is None:
            return None
        natural = t_bar * nat[0] * nat[1] * f * f
        if nat[0] * nat[1] == n:
            return "max_pixels", natural, nat
        # shrink branch (engine max_pixels below the natural size), then grow branch (engine
        # min_pixels above it); each is monotone in its budget. With frames sharing the
        # budget (T odd) either branch can land on either side of the natural count.
        found = None
        if natural > 1:
            found = first_landing(1, natural - 1, n, lambda m: self._cells(h, w, t, 1, m))
        if found:
            return "max_pixels", *found
        top = max(natural + 1, frames * n * f * f)
        found = first_landing(natural + 1, top, n, lambda m: self._cells(h, w, t, m, _NO_CAP))
        return ("min_pixels", *found) if found else None

    def _keep_pixels(self, a: int, b: int, t: int) -> int | None:
        """The budget (min_pixels = max_pixels) at which the processor keeps an (a*f, b*f)
        frame as it is, its (frame-weighted) area, where it takes the frame at all; else None."""
        f, (_, t_bar) = self.factor, self._frames(t)
        px = max(t_bar, 1) * a * b * f * f
        return px if self._cells(a * f, b * f, t, px, px) == (a, b) else None

    def _solve(self, n_total: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        """Engine-replay where the processor's resize of the source under some min_pixels or
        max_pixels gives the target (``hw_kind="source"``); else the grid of that many cells
        closest in aspect that the processor keeps unchanged at some budget (``budget``:
        min_pixels = max_pixels = it)."""
        t = max(t, self.min_frames)
        f, g = self.factor, groups(t, self.temporal_patch)
        try:
            self._resize(h, w, t, self.min_pixels, self.max_pixels)
        except GeometryError as exc:
            return unreachable(str(exc), t)
        n = per_group(n_total, t, self.temporal_patch)
        if isinstance(n, Solution):
            return n

        def solution(a: int, b: int, fidelity, reason: str, budget: int) -> Solution:
            grid = (a * self.merge, b * self.merge)
            size = (a * f, b * f)
            return Solution(n_total, size, fidelity, reason, grid, num_frames=t, budget=budget)

        replay = self._replay(h, w, t, n) if kind == "source" else None
        if replay is not None:  # the engine resizes the source: its grid whether or not
            knob, budget, (a, b) = replay  # the processor would keep that frame when fed back
            other = "min_pixels 1" if knob == "max_pixels" else "no max_pixels"
            why = (
                f"the processor's resize with {knob}={budget} ({other}) gives {a}x{b} "
                f"merged cells x {g} group(s) = {n_total}"
            )
            return solution(a, b, "engine-replay", why, budget)
        valid = {(a, b): px for a, b in divisor_pairs(n) if (px := self._keep_pixels(a, b, t))}
        if not valid:
            return unreachable(
                f"{n_total} tokens: every grid a*b = {n} merged cells has aspect ratio above "
                f"{self.max_aspect:g} (or the processor resizes it again at every budget)",
                t,
            )
        (a, b), fidelity, count = pick(list(valid), (h, w), (f, f))
        lead = (
            "with only a processed frame's size"
            if kind == "frame"
            else f"no pixel budget makes the processor give {n} merged cells per group for {h}x{w}"
        )
        why = (
            f"{lead}; {choice_text(count, a, b, f'of {n} cells')} (kept unchanged at "
            f"min_pixels = max_pixels = {valid[(a, b)]}; aspect)"
        )
        return solution(a, b, fidelity, why, valid[(a, b)])
