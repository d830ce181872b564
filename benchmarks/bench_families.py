"""The family engine (install_vlm) on transformers' tiny Nemotron 3 Nano Omni, CPU, no grad.

Figures (issue 16):

- spec size: lines of each family's spec module (target <= 150, tests aside);
- aligned path: the guarded forward vs the plain forward on the same batch, interleaved, the
  guard's share = (guarded - plain) / plain (the tower runs in both: the guard runs it through
  the model's own method instead of the model's forward; target <= 1 %), and the guard's
  device-to-host transfers per forward (target 1), at a small batch and at b=4, s=8192;
- the seed's case: 16 frames of 2400x1080 sized by the engine in a ~32k prompt (runs of 2010)
  against the trainer's 2550-feature grids: the RADIO solver's grid and fidelity class for the
  run's length, and the resize of one item's patch rows on CPU (rows -> image -> bicubic +
  antialias -> rows), per item.

Run: ``python -m benchmarks --only families`` (or ``python benchmarks/bench_families.py``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from megatron_media_guard import GuardConfig
from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.families import layouts
from megatron_media_guard.geometry import RadioTilerGeometry
from megatron_media_guard.repair.reproject import resize_frames
from megatron_media_guard.testing.families import nemotron_omni as F
from megatron_media_guard.testing.families.base import Media

SPECS = Path(__file__).resolve().parents[1] / "megatron_media_guard" / "families"
TOKENS = {"<img>": F.IMG_START, "</img>": F.IMG_END, "<so_start>": F.SO_START, "<so_end>": F.SO_END}


def _times(fns, reps: int) -> list[float]:
    for fn in fns:
        fn()
    acc: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, a in zip(fns, acc, strict=True):
            t0 = time.perf_counter()
            fn()
            a.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(a) for a in acc]


def _spec_rows() -> list[dict]:
    skip = {"__init__.py", "spec.py", "collate.py", "layouts.py", "evs.py", "megatron.py"}
    rows = []
    for p in sorted(SPECS.glob("*.py")):
        if p.name in skip:
            continue
        n = len(p.read_text().splitlines())
        rows.append(
            dict(
                benchmark=f"families/spec-lines/{p.stem}",
                metric="lines",
                value=n,
                target="<= 150",
                note="the family's spec module, docstring included",
            )
        )
    return rows


def _aligned(model, samples, reps: int, label: str) -> list[dict]:
    b = F.make_batch(model, samples)
    tokens = b.input_ids.numel()

    def plain():
        with torch.no_grad():
            model(**b.kwargs)

    handle = install_vlm(model, GuardConfig(), tokenizer=TOKENS)
    handle.remove()

    def guarded():
        handle.install_hooks()
        try:
            with torch.no_grad():
                model(**b.kwargs)
        finally:
            handle.remove()

    with count_transfers() as seen:
        guarded()
    p, g = _times([plain, guarded], reps)
    share = (g - p) / p
    return [
        dict(
            benchmark=f"families/nemotron/aligned/{label}",
            metric="guard share of forward",
            value=share,
            target="<= 0.01",
            note=f"{tokens} tokens; plain {p:.0f} ms, guarded {g:.0f} ms (median of {reps})",
        ),
        dict(
            benchmark=f"families/nemotron/aligned/{label}",
            metric="d2h transfers",
            value=sum(seen.values()),
            target="<= 1",
            note=", ".join(seen) or "none",
        ),
    ]


def _seed_case() -> list[dict]:
    geo = RadioTilerGeometry(patch=16, pixel_shuffle=2)
    hw = (1080, 2400)
    trainer = geo.grid_for(hw)
    sol = geo.solve(2010, hw)
    gh, gw = trainer
    rows = torch.randn(gh * gw, 3 * 16 * 16)
    ph, pw = sol.size_hw

    def resize():
        img = layouts.patches_to_image(rows, gh, gw)[None]
        layouts.image_to_patches(resize_frames(img, (ph, pw))[0])

    (ms,) = _times([resize], 5)
    note = (
        f"trainer grid {gh}x{gw} ({gh * gw // 4} features) -> {sol.grid} "
        f"({sol.tokens} tokens), fidelity {sol.fidelity}"
    )
    return [
        dict(
            benchmark="families/nemotron/seed-repair",
            metric="resize ms per item",
            value=ms,
            target="-",
            note=note,
        ),
        dict(
            benchmark="families/nemotron/seed-repair",
            metric="x16 items ms",
            value=16 * ms,
            target="-",
            note="the 16 frames of the seed's prompt, resize only (no encoder)",
        ),
    ]


def run(quick: bool = False) -> list[dict]:
    rows = _spec_rows()
    model = F.tiny_model()
    img = Media("image", (8, 8))
    rows += _aligned(model, [[img, img], [img]], 3 if quick else 15, "small")
    if not quick:
        big = Media("image", (64, 64))  # 1024 tokens each: 8 per row fill 8192 tokens
        rows += _aligned(model, [[big] * 8] * 4, 3, "b4-s8192")
    rows += _seed_case()
    return rows


if __name__ == "__main__":
    from benchmarks.__main__ import format_table

    print(format_table(run()))
