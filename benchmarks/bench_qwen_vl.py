"""Qwen-VL pre-hook cost (install_qwen_vl) on transformers' tiny Qwen2.5-VL, CPU, no grad.

Figures (issue 8):

- aligned path: the guarded forward vs the plain forward of the tiny model on the same
  processor-made batch, and the pre-hook alone (the guard's own
  part: bind the call, check every run against the grid rows on the device, one transfer, the
  consensus round), best of the interleaved reps. The tiny model (hidden 64, 2 layers) is a floor for any real forward, so
  "pre-hook alone / tiny forward" bounds the share of a realistic forward from above; target
  <= 1 %. Measured at a small batch and at b=4, s=8192 with 64 image runs.
- keep_tower (issue 20): on a text-only micro-batch ``keep_tower="always"`` runs the vision
  tower on one dummy 2x2 cell in the pre-hook; its cost alone and the guarded training step
  (forward + backward) under "always" vs "never", against the tiny model's text-only forward,
  (forward at b=2 s=64 and b=4 s=256, the step at b=2 s=64).
- repair: vision-tower calls per guarded forward (must equal the plain forward's) and the
  resize cost per repaired item (unfold, bicubic+antialias resize, re-patchify) at realistic
  trainer sizes.

Run: ``python -m benchmarks --only qwen_vl`` (or ``python benchmarks/bench_qwen_vl.py``).
"""

from __future__ import annotations

import statistics
import time

import torch

from megatron_media_guard import Grammar, GuardConfig, MediaGuard
from megatron_media_guard.adapters import install_qwen_vl
from megatron_media_guard.geometry import PatchMergeGeometry
from megatron_media_guard.repair.pixels import from_frames
from megatron_media_guard.repair.reproject import resize_patches
from megatron_media_guard.testing.qwen_vl import (
    END,
    IMAGE,
    START,
    Sample,
    build_batch,
    seed_failure,
    smooth_clip,
    smooth_image,
    source_items,
    tiny_model,
)

FAMILY, PATCH = "qwen2_5_vl", 14
F = PATCH * 2


def _median_ms(fns: list, reps: int, best: bool = False) -> list[float]:
    """Median (or with ``best`` the minimum) wall ms of each of ``fns``, timed alternately."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            acc.append((time.perf_counter() - t0) * 1e3)
    return [min(t) if best else statistics.median(t) for t in times]


def _guard(policy: str = "raise") -> MediaGuard:
    geo = PatchMergeGeometry(patch=PATCH, min_pixels=F * F, max_pixels=30 * F * F)
    return MediaGuard(GuardConfig(policy=policy), grammar=Grammar.qwen2_vl(), geometry=geo)


def _aligned(model, kwargs: dict, reps: int) -> list[float]:
    """Best-of-reps ms of the plain forward, the guarded forward and the pre-hook alone."""
    h = install_qwen_vl(model, _guard())
    h.remove()

    def guarded():
        h.install_hooks()
        try:
            return model(**kwargs)
        finally:
            h.remove()

    def hook_alone():  # what the guard adds to a forward: the pre-hook with these inputs
        return h._pre_hook((), kwargs)

    # best of reps: on a shared machine a load spike swamps a few-ms difference in a median
    return _median_ms([lambda: model(**kwargs), guarded, hook_alone], reps, best=True)


def _long_batch(b: int = 4, s: int = 8192, runs: int = 16, grid: int = 8) -> dict:
    """b rows of s tokens with ``runs`` image runs each (grid x grid patches per image)."""
    n = grid * grid // 4
    row = [7] * 16
    for _ in range(runs):
        row += [START, *[IMAGE] * n, END] + [7] * 8
    row += [7] * (s - len(row))
    ids = torch.tensor([row] * b)
    k = b * runs
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(k * grid * grid, 3 * 2 * PATCH * PATCH),
        "image_grid_thw": torch.tensor([[1, grid, grid]] * k),
    }


def run(quick: bool = False) -> list[dict]:
    torch.manual_seed(0)
    reps = 3 if quick else 15
    rows: list[dict] = []
    model = tiny_model(FAMILY)
    imgs = [smooth_image(150 + 14 * k, 200, k) for k in range(4)]
    small = build_batch([Sample((("image", a),)) for a in imgs], FAMILY, PATCH, 30 * F * F)
    with torch.no_grad():
        t_plain, t_guarded, t_hook = _aligned(model, small, reps)
    s_small = tuple(small["input_ids"].shape)
    note = f"b x s = {s_small}, 4 images; CPU {torch.get_num_threads()} threads, best of {reps}"
    rows += [
        _row("aligned: tiny forward, plain (ms)", t_plain, "-", note),
        _row("aligned: guarded / plain - 1 (%)", 100 * (t_guarded / t_plain - 1), "-", note),
        _row("aligned: pre-hook alone (ms)", t_hook, "-", note),
        _row("aligned: pre-hook / tiny forward (%)", 100 * t_hook / t_plain, "<= 1", note),
    ]
    big = _long_batch(s=2048 if quick else 8192)
    inner = model.model
    with torch.no_grad():
        t_plain, _, t_hook = _aligned(inner, big, max(3, reps // 3))
    note = f"b x s = {tuple(big['input_ids'].shape)}, 64 image runs; Qwen2_5_VLModel (no lm head)"
    rows += [
        _row("aligned long: pre-hook alone (ms)", t_hook, "-", note),
        _row("aligned long: pre-hook / tiny forward (%)", 100 * t_hook / t_plain, "<= 1", note),
    ]
    rows += _keep_tower_rows(model, reps)
    rows += _repair_rows(model, reps)
    return rows


def _cpu_ms(fns: list, reps: int) -> list[float]:
    """Minimum CPU ms of this thread for each of ``fns`` (interleaved, torch on 1 thread): on a
    shared machine wall time swings 5x between calls, one thread's CPU time far less."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in fns:
            fn()
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(reps):
            for fn, acc in zip(fns, times, strict=True):
                t0 = time.thread_time()
                fn()
                acc.append((time.thread_time() - t0) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return [min(t) for t in times]


def _keep_tower_rows(model, reps: int) -> list[dict]:
    from megatron_media_guard.families import qwen

    def dummy():
        return qwen.dummy(model)

    handles = {}
    for mode in ("always", "never"):
        cfg = GuardConfig(keep_tower=mode)
        handles[mode] = install_qwen_vl(model, MediaGuard(cfg, grammar=Grammar.qwen2_vl()))
        handles[mode].remove()
    rows = []
    for b, s in ((2, 64), (4, 256)):
        g = torch.Generator().manual_seed(0)
        text = {"input_ids": torch.randint(100, 1000, (b, s), generator=g)}
        with torch.no_grad():
            t_fwd, t_dummy = _cpu_ms([lambda t=text: model(**t), dummy], reps)
        note = f"text-only b x s = ({b}, {s}); dummy: one 2x2 cell (4 patches); min CPU time of {reps}, 1 thread"
        rows += [
            _row(f"keep_tower: dummy tower call, s={s} (ms)", t_dummy, "-", note),
            _row(f"keep_tower: text-only forward, s={s} (ms)", t_fwd, "-", note),
            _row(
                f"keep_tower: dummy / text-only forward, s={s} (%)",
                100 * t_dummy / t_fwd,
                "-",
                note,
            ),
        ]

    def step(mode: str) -> None:  # forward + backward at (2, 64): the last `text`'s first rows
        h = handles[mode]
        h.install_hooks()
        try:
            ids = text["input_ids"][:2, :64]
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            h.remove()
            model.zero_grad(set_to_none=True)

    t_always, t_never = _cpu_ms([lambda: step("always"), lambda: step("never")], reps)
    note = f"text-only b x s = (2, 64), forward + backward; min CPU time of {reps}, 1 thread"
    rows.append(
        _row(
            "keep_tower: train step always / never - 1 (%)",
            100 * (t_always / t_never - 1),
            "-",
            note,
        )
    )
    return rows


def _repair_rows(model, reps: int) -> list[dict]:
    samples = [
        Sample((("image", smooth_image(150, 200, 1)),)),
        Sample((("video", smooth_clip(4, 150, 180, 2)),)),
    ]
    engine, mixed = seed_failure(FAMILY, samples, 12, 30)
    calls: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        with torch.no_grad():
            model(**engine)
            plain_calls = len(calls)
            calls.clear()
            with install_qwen_vl(model, _guard("repair")) as h:
                h.set_items(source_items(samples, mixed))  # the originals' sizes
                model(**mixed)
            assert h.last_result.report.actions == ("repair", "repair")
            repaired_calls = len(calls)
    finally:
        hook.remove()
    note = "image + video batch, both repaired; HF encodes images and videos separately"
    rows = [
        _row("repair: tower calls, plain engine-sized", plain_calls, "-", note),
        _row("repair: tower calls, guarded repair", repaired_calls, "= plain", note),
    ]
    for name, frames, hw, to in (
        ("image 1036x1484 -> 728x1036", 1, (1036, 1484), (728, 1036)),
        ("video 16 frames 336x756 -> 252x560", 16, (336, 756), (252, 560)),
    ):
        clip = torch.randn(1, 3, *hw).expand(2, -1, -1, -1) if frames == 1 else None
        if clip is None:
            clip = torch.randn(frames, 3, *hw)
        patches, meta = from_frames(clip, "qwen_patches", patch=PATCH)
        thw = tuple(meta["grid_thw"][0].tolist())
        (ms,) = _cpu_ms([lambda p=patches, g=thw, t=to: resize_patches(p, g, t, patch=PATCH)], reps)
        rows.append(_row(f"repair: resize per item, {name} (ms)", ms, "-", "CPU, float32"))
    return rows


def _row(metric: str, value: float, target: str, note: str) -> dict:
    return {
        "benchmark": "qwen_vl",
        "metric": metric,
        "value": round(float(value), 4),
        "target": target,
        "note": note,
    }


if __name__ == "__main__":
    for r in run():
        print(f"{r['metric']:48} {r['value']:>10} {r['target']:>8}  {r['note']}")
