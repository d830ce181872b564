"""The family guards (install_vlm) on every family fixture's tiny transformers model, CPU.

Figures (issues 16 and 17):

- spec size: lines of each family's spec module (target <= 150, tests aside);
- aligned path, per family (``benchmarks/family_cases.py``: 4 samples of ~8192 tokens, the
  family's media at real checkpoints' item sizes, text filling the rows): the plain and the
  guarded forward, interleaved, no grad, in CPU time of one thread (``benchmarks/hook_cost.py``;
  the vocabulary projection keeps the last position in both), the guarded forward's share over
  the plain one, and the guard's own pre-hook work (the pre-hook minus the model's own calls it
  makes on the model's behalf: feature methods / towers, rope index, token embeddings) as a
  share of the plain forward (target <= 1 %), with its device-to-host transfers (target 1);
- the seed's case: 16 frames of 2400x1080 sized by the engine in a ~32k prompt (runs of 2010)
  against the trainer's 2550-feature grids: the RADIO solver's grid and fidelity class for the
  run's length, and the resize of one item's patch rows on CPU (rows -> image -> bicubic +
  antialias -> rows), per item.

Run: ``python -m benchmarks --only families`` (or ``python benchmarks/bench_families.py``);
``--quick``: one small batch per family, 2 reps.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.family_cases import Case, build, cases, set_items, tokenizer
from benchmarks.hook_cost import HookCost, measure
from megatron_media_guard import GuardConfig
from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.families import layouts
from megatron_media_guard.geometry import RadioTilerGeometry
from megatron_media_guard.repair.reproject import resize_frames

SPECS = Path(__file__).resolve().parents[1] / "megatron_media_guard" / "families"
SEQ = 8192  # tokens per sample, 4 samples
REPS = 3  # interleaved (plain, guarded) pairs per case, after one guarded warm-up


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
    rows = []
    for p in sorted(SPECS.glob("*.py")):
        text = p.read_text()
        if p.name == "megatron.py" or not re.search(r"^(SPEC|BRIDGE)\b", text, re.M):
            continue  # the engine's own modules (inputs, collate, derived, ...), no family spec
        n = len(text.splitlines())
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


def _aligned(case: Case, seq: int, reps: int, target: str) -> list[dict]:
    model, batch = build(case, seq)
    handle = install_vlm(model, GuardConfig(), tokenizer=tokenizer(case.family))
    handle.remove()
    items = set_items(case, batch)
    c = measure(model, handle, batch.kwargs, reps, items=items)
    b, s = batch.input_ids.shape
    name = f"families/{case.family}/aligned/{case.label}"
    shape = f"{b}x{s} tokens, {len(batch.items)} items" + (", set_items" if items else "")
    return _rows(name, shape, c, target)


def _rows(name: str, shape: str, c: HookCost, target: str) -> list[dict]:
    calls = ", ".join(f"{k} {v:.1f}" for k, v in c.calls.items()) or "none"
    lo, hi = min(c.own), max(c.own)
    return [
        dict(
            benchmark=name,
            metric="guard's own pre-hook work / plain forward",
            value=c.own_ms / c.plain,
            target=target,
            note=(
                f"{shape}; own {c.own_ms:.1f} ms (range {lo:.1f}-{hi:.1f}) = pre-hook "
                f"{c.hook:.1f} - model's calls in it ({calls}); plain {c.plain:.0f} ms"
            ),
        ),
        dict(
            benchmark=name,
            metric="own work net of the merge it replaces / plain forward",
            value=c.net_ms / c.plain,
            target=target,
            note=(
                f"own {c.own_ms:.1f} ms - the plain forward's own merge {c.merge:.1f} ms "
                "(get_placeholder_mask + masked_scatter, which the guarded forward skips)"
            ),
        ),
        dict(
            benchmark=name,
            metric="(guarded - plain) / plain",
            value=(c.guarded - c.plain) / c.plain,
            target="info",
            note=(
                f"plain {c.plain:.0f} ms, guarded {c.guarded:.0f} ms: CPU ms of 1 thread, "
                f"median of {c.reps} interleaved"
            ),
        ),
        dict(
            benchmark=name,
            metric="d2h transfers per guarded forward",
            value=sum(c.transfers.values()),
            target="<= 1",
            note="; ".join(f"{n}x {why}" for why, n in c.transfers.items()) or "none",
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


def _load(start: float) -> dict:
    end = os.getloadavg()[0]
    return dict(
        benchmark="families/machine",
        metric="load average (1 min), end of the aligned rows",
        value=end,
        target="info",
        note=f"at their start {start:.2f}; {os.cpu_count()} cores (CPU time rows: 1 thread)",
    )


def run(quick: bool = False, only: tuple[str, ...] = ()) -> list[dict]:
    """``only``: family fixture names (default all)."""
    rows = _spec_rows()
    start = os.getloadavg()[0]
    for case in cases(quick):
        if only and case.family not in only:
            continue
        if quick:
            rows += _aligned(case, 256, 2, "info (small shape)")
        else:
            rows += _aligned(case, SEQ, REPS, "<= 0.01")
        gc.collect()
    rows.append(_load(start))
    rows += _seed_case()
    return rows


if __name__ == "__main__":
    from benchmarks.__main__ import format_table

    print(format_table(run(only=tuple(sys.argv[1:]))))
