"""Repair cost: re-encoding 1 mismatched item vs encoding the whole batch of 16.

Target (docs/BENCHMARKS.md, "repair re-encodes only the mismatched items"): repairing one
item of a 16-item batch costs at most 1.5/16 of encoding all 16, i.e.
``16 * t_repair / t_batch <= 1.5``. ``t_repair`` is one ``reencode`` call (recover
frames from Qwen2-VL patches, bicubic+antialias resize, re-patchify, encode);
``t_batch`` is one encoder call on the 16 items' patches concatenated, as the
trainer's vision tower sees them. Same small position-wise encoder on both sides
(patch embed, an MLP block, 2x2 merger, projector), CPU, no grad, median of reps.

Run: ``python -m benchmarks.bench_repair`` (or ``python benchmarks/bench_repair.py``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from megatron_media_guard.repair.pixels import from_frames
from megatron_media_guard.repair.reproject import reencode

PATCH, MERGE = 14, 2
BATCH = 16


@dataclass(frozen=True)
class _Target:
    tokens: int
    size_hw: tuple[int, int]


class _Encoder(nn.Module):
    """``[n, 1176]`` -> ``[n / 4, out]``: patch embed, residual MLP, merger, projector."""

    def __init__(self, hidden: int = 256, out: int = 512) -> None:
        super().__init__()
        self.embed = nn.Linear(3 * 2 * PATCH * PATCH, hidden)
        self.mlp = nn.Sequential(
            nn.LayerNorm(hidden),
            nn.Linear(hidden, 4 * hidden),
            nn.GELU(),
            nn.Linear(4 * hidden, hidden),
        )
        self.merger = nn.Sequential(
            nn.Linear(hidden * MERGE * MERGE, out), nn.GELU(), nn.Linear(out, out)
        )

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches)
        x = x + self.mlp(x)
        return self.merger(rearrange(x, "(n m) h -> n (m h)", m=MERGE * MERGE))


def _median_ms(fns: list, reps: int) -> list[float]:
    """Median wall ms of each of ``fns``, timed alternately so drift hits all alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, acc in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            acc.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(acc) for acc in times]


def run(quick: bool = False) -> list[dict]:
    """Rows: repair ms, batch ms, and 16 x repair / batch (target <= 1.5)."""
    torch.manual_seed(0)
    side = 224 if quick else 448
    reps = 3 if quick else 9
    target_hw = (side - 28, side + 28)  # a near-equal pixel count: a fair 1-vs-16 comparison
    encoder = _Encoder().eval()
    items = []
    for _ in range(BATCH):
        image = torch.randn(1, 3, side, side).expand(2, -1, -1, -1)
        patches, meta = from_frames(image, "qwen_patches", patch=PATCH, merge=MERGE)
        items.append((patches, meta["grid_thw"]))
    batch_pixels = torch.cat([p for p, _ in items])
    batch_grid = torch.cat([g for _, g in items])
    tokens = (target_hw[0] // (PATCH * MERGE)) * (target_hw[1] // (PATCH * MERGE))
    target = _Target(tokens, target_hw)
    bad_pixels, bad_grid = items[BATCH // 2]

    with torch.no_grad():
        t_batch, t_repair = _median_ms(
            [
                lambda: encoder(batch_pixels, grid_thw=batch_grid),
                lambda: reencode(bad_pixels, "qwen_patches", target, encoder, grid_thw=bad_grid),
            ],
            reps,
        )
    ratio = BATCH * t_repair / t_batch
    shape = f"{BATCH} images {side}x{side} -> 1 repaired to {target_hw[0]}x{target_hw[1]} ({tokens} tokens)"
    note = f"CPU {torch.get_num_threads()} threads, median of {reps}; {shape}"
    return [
        {
            "benchmark": "repair",
            "metric": "reencode 1 item (ms)",
            "value": round(t_repair, 3),
            "target": "-",
            "note": note,
        },
        {
            "benchmark": "repair",
            "metric": f"encode batch of {BATCH} (ms)",
            "value": round(t_batch, 3),
            "target": "-",
            "note": note,
        },
        {
            "benchmark": "repair",
            "metric": f"{BATCH} x repair / batch encode",
            "value": round(ratio, 3),
            "target": "<= 1.5",
            "note": "1 of 16 items repaired costs this many sixteenths of re-encoding all",
        },
    ]


if __name__ == "__main__":
    for row in run():
        print(
            f"{row['benchmark']:8} {row['metric']:32} {row['value']:>10} {row['target']:>8}  {row['note']}"
        )
