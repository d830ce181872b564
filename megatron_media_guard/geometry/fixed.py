"""Fixed resolution: LLaVA-1.5 (336 x 336 -> 576 tokens), Gemma 3 crops (896 -> 256).

Every image (or frame) is resized to one size and yields one count; only the number
of images / crops can change a count, which sizing cannot repair.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_media_guard.geometry.solution import (
    Geometry,
    HwKind,
    Solution,
    check_frames,
    check_hw,
    check_positive,
    unreachable,
)


@dataclass(frozen=True)
class FixedGeometry(Geometry):
    """tokens_per_image per image or frame; every frame resized to ``size`` (H, W)."""

    tokens_per_image: int = 576
    size: tuple[int, int] = (336, 336)

    def __post_init__(self) -> None:
        check_positive(self.tokens_per_image, "tokens_per_image")
        object.__setattr__(self, "size", check_hw(self.size))

    def size_for(self, hw: tuple[int, int], num_frames: int = 1) -> tuple[int, int]:
        check_hw(hw)
        check_frames(num_frames)
        return self.size

    def tokens(self, hw: tuple[int, int], num_frames: int = 1) -> int:
        check_hw(hw)
        return check_frames(num_frames) * self.tokens_per_image

    def _solve(self, n: int, h: int, w: int, t: int, kind: HwKind) -> Solution:
        """Reachable only for num_frames * tokens_per_image: the processor's one size (a
        replay from the source or a frame alike: there is no other)."""
        want = t * self.tokens_per_image
        if n != want:
            extra = (
                f" ({n // self.tokens_per_image} images/crops, not {t})"
                if n and n % self.tokens_per_image == 0
                else ""
            )
            return unreachable(
                f"a fixed-resolution item of {t} frame(s) always yields {want} tokens; "
                f"{n} cannot be reached by resizing{extra}",
                t,
            )
        size = f"{self.size[0]}x{self.size[1]}"
        why = f"the processor resizes every frame to {size} -> {self.tokens_per_image} tokens each"
        return Solution(n, self.size, "engine-replay", why, None, num_frames=t)
