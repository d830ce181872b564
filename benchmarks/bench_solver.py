"""The exact-count solver: time per item, per geometry family (target <= 1 ms per item).

Per family, a seeded workload of media sizes (16 px .. 6000 px sides, some narrow) and
targets up to 16k tokens: half the family's own count (the engine-replay path), half
random counts (the fallback and unreachable paths; tiles: multiples of 256). Reported:
mean and 99th percentile of ``solve`` in ms (per item the best of 3 runs), plus the mix
of fidelity classes.

Also the worst case over a sweep of extreme aspects (to 100000:1) and huge targets per
family (``extreme_rows``): the RADIO budget walk used to grow with the aspect ratio.

Run: ``python -m benchmarks.bench_solver``.
"""

from __future__ import annotations

import random
import statistics
import time

from megatron_media_guard.geometry import (
    FixedGeometry,
    PatchMergeGeometry,
    RadioTilerGeometry,
    TiledGeometry,
)

FAMILIES = {
    "qwen2-vl": PatchMergeGeometry.qwen2_vl(),
    "qwen3-vl-video": PatchMergeGeometry.qwen3_vl_video(),
    "radio": RadioTilerGeometry(),
    "tiles": TiledGeometry(),
    "fixed": FixedGeometry(),
}


def _workload(name: str, geo, count: int, seed: int) -> list[tuple[int, tuple[int, int], int]]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        h = rng.randint(16, 6000)
        w = rng.choice([rng.randint(16, 6000), rng.randint(16, 200)])
        if max(h, w) / min(h, w) > 200:
            continue
        frames = rng.choice([2, 4, 16]) if name.endswith("video") else 1
        if len(out) % 2 == 0:
            target = geo.tokens((h, w), frames)
        elif name == "tiles":
            target = 256 * rng.randint(1, 14)
        else:
            target = rng.randint(1, 16384)
        out.append((target, (h, w), frames))
    return out


def _time_solves(geo, work, repeats: int) -> tuple[list[float], dict[str, int]]:
    """Per item the best of ``repeats`` solves (filters scheduler noise on a shared machine)."""
    times, mix = [], {}
    for target, hw, frames in work:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            sol = geo.solve(target, hw, frames)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
        mix[sol.fidelity] = mix.get(sol.fidelity, 0) + 1
    return times, mix


def _seed_case_ms(reps: int) -> float:
    radio = RadioTilerGeometry()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        radio.solve(2010, (1080, 2400))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


EXTREME_FAMILIES = {**FAMILIES, "radio-uncapped": RadioTilerGeometry(max_num_patches=None)}
ASPECTS = (1, 10, 100, 200, 201, 1000, 5000, 10_000, 100_000)
SHORT_SIDES = (1, 16, 28, 64, 300)
BIG_TARGETS = (1, 256, 4096, 16384, 100_000, 720_720, 2**20)  # 720720: 240 divisors


def _own(geo, hw, frames):
    try:
        return geo.tokens(hw, frames)
    except Exception:  # e.g. past the processor's aspect limit
        return None


def extreme_rows(quick: bool = False) -> list[dict]:
    """The worst ``solve`` over a sweep of extreme aspects (up to 100000:1, both
    orientations) and targets (the item's own count and its neighbour, up to 2**20 and the
    highly composite 720720), per family: best of 3 per input, the maximum reported."""
    aspects = ASPECTS[::2] if quick else ASPECTS
    rows = []
    for name, geo in EXTREME_FAMILIES.items():
        frames = 4 if name.endswith("video") else 1
        worst = (0.0, None)
        count = 0
        for a in aspects:
            for short in SHORT_SIDES:
                for hw in ((short, short * a), (short * a, short)):
                    own = _own(geo, hw, frames)
                    extra = {own, own + 1} if own else set()
                    for target in sorted(set(BIG_TARGETS) | extra):
                        best = float("inf")
                        for _ in range(1 if quick else 3):
                            t0 = time.perf_counter()
                            sol = geo.solve(target, hw, frames)
                            best = min(best, time.perf_counter() - t0)
                        count += 1
                        if best > worst[0]:
                            worst = (best, (hw, target, sol.fidelity))
        hw, target, fid = worst[1]
        rows.append(
            {
                "benchmark": f"solver/{name}",
                "metric": "worst solve ms over the extreme sweep",
                "value": worst[0] * 1e3,
                "target": "<= 1",
                "note": f"{count} inputs, aspects to {aspects[-1]}:1; worst at hw={hw}, "
                f"target {target} ({fid})",
            }
        )
    return rows


def run(quick: bool = False) -> list[dict]:
    count = 400 if quick else 4000
    rows: list[dict] = []
    for i, (name, geo) in enumerate(FAMILIES.items()):
        work = _workload(name, geo, count, seed=100 + i)
        _time_solves(geo, work[:50], 1)  # warm-up
        times, mix = _time_solves(geo, work, 1 if quick else 3)
        times.sort()
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        note = f"{len(work)} items, targets <= 16384; " + ", ".join(
            f"{k} {v}" for k, v in sorted(mix.items())
        )
        rows.append(
            {
                "benchmark": f"solver/{name}",
                "metric": "solve ms/item (mean)",
                "value": statistics.fmean(times) * 1e3,
                "target": "<= 1",
                "note": note,
            }
        )
        rows.append(
            {
                "benchmark": f"solver/{name}",
                "metric": "solve ms/item (p99)",
                "value": p99 * 1e3,
                "target": "<= 1",
                "note": f"max {times[-1] * 1e3:.3f} ms",
            }
        )
    rows += extreme_rows(quick)
    rows.append(
        {
            "benchmark": "solver/seed-case",
            "metric": "solve(2010, 1080x2400) ms (median)",
            "value": _seed_case_ms(50 if quick else 500),
            "target": "<= 1",
            "note": "RADIO engine-replay: grid 60x134",
        }
    )
    return rows


if __name__ == "__main__":
    for row in run():
        print(
            f"{row['benchmark']:<22} {row['metric']:<36} {row['value']:>9.4f}  "
            f"target {row['target']:<6} {row['note']}"
        )
