"""The fault path's cost: peak memory and time of raise / drop one / drop all vs the aligned
merge (CPU, b=4, s=16384, h=1024 bf16, 64 runs per row: the aligned-merge benchmark's batch).

Memory: each case runs in a fresh subprocess (``python -m benchmarks.bench_fault_path --mem
CASE``): inputs built, one small warm-up call (lazy imports), then the kernel's peak-RSS mark
is reset (``/proc/self/clear_refs``) and the call measured as ``VmHWM - VmRSS before``, as a
multiple of the embeddings' bytes (the output itself is 1.0x; a drop keeps it). Two runs per
case, the larger reported. Time: the four cases interleaved in one process, median of reps,
as a ratio to the aligned merge; ``rounds`` such ratios, median and range reported.

A bad sample: one feature moved between the first two items of the sample (same totals, same
tokens, a length mismatch), so every case holds the same tensors.

Run: ``python -m benchmarks.bench_fault_path``.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import torch

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.core.grammar import Grammar
from megatron_media_guard.testing import build_batch

G = Grammar.qwen2_vl()
CASES = {  # name -> (policy, bad samples)
    "aligned": ("raise", ()),
    "raise, 1 of 4 bad": ("raise", (0,)),
    "drop, 1 of 4 bad": ("drop", (1,)),
    "drop, all 4 bad": ("drop", (0, 1, 2, 3)),
}
MEM_TARGET = {"drop, 1 of 4 bad": 1.25, "drop, all 4 bad": 1.25}
TIME_TARGET = {"drop, 1 of 4 bad": 2.0, "drop, all 4 bad": 2.0}


def sizes(quick: bool) -> tuple[int, int, int, int]:
    """(b, s, h, runs per row); b is 4 in both: the cases name samples 0..3."""
    return (4, 2048, 256, 16) if quick else (4, 16384, 1024, 64)


def inputs(bad, b: int, s: int, h: int, runs: int):
    per = (s - 8) // runs - 5
    batch = build_batch(G, [[("image", per)] * runs for _ in range(b)], seq_len=s, text=2)
    items = list(batch.items)
    if any(smp >= b for smp in bad):
        raise ValueError(f"bad samples {bad} for a batch of {b}")
    for smp in bad:
        i = smp * runs
        items[i] = replace(items[i], num_features=items[i].num_features + 1)
        items[i + 1] = replace(items[i + 1], num_features=items[i + 1].num_features - 1)
    emb = torch.randn(b, s, h, dtype=torch.bfloat16)
    feats = torch.randn(sum(it.num_features for it in items), h, dtype=torch.bfloat16)
    return emb, batch.input_ids, feats, items


def _call(guard: MediaGuard, emb, ids, feats, items):
    try:
        return guard.merge(emb, ids, feats, items)
    except MediaAlignmentError:
        return None


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        rows = dict(line.split(":", 1) for line in f)
    return {k: int(rows[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def measure_memory(case: str, quick: bool) -> float:
    """Peak RSS of one guarded call above the RSS before it, in embeddings' bytes."""
    logging.disable(logging.CRITICAL)
    policy, bad = CASES[case]
    guard = MediaGuard(GuardConfig(policy=policy), grammar=G)
    _call(guard, *inputs(bad[:1], 2, 1024, 16, 4))  # warm-up: lazy imports, first use
    emb, ids, feats, items = inputs(bad, *sizes(quick))
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark
        f.write("5")
    before = _status()["VmRSS"]
    res = _call(guard, emb, ids, feats, items)
    peak = _status()["VmHWM"]
    del res
    return (peak - before) / (emb.numel() * emb.element_size())


def _memory_in_subprocess(case: str, quick: bool) -> float | None:
    cmd = [sys.executable, "-m", "benchmarks.bench_fault_path", "--mem", case]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return None
    return float(out.stdout.strip().splitlines()[-1])


def time_ratios(quick: bool, rounds: int) -> dict[str, list[float]]:
    logging.disable(logging.CRITICAL)
    data = {k: inputs(bad, *sizes(quick)) for k, (_, bad) in CASES.items()}
    guards = {k: MediaGuard(GuardConfig(policy=p), grammar=G) for k, (p, _) in CASES.items()}
    for k in CASES:  # warm-up
        _call(guards[k], *data[k])
    reps = 3 if quick else 7
    ratios: dict[str, list[float]] = {k: [] for k in CASES}
    for _ in range(rounds):
        times: dict[str, list[float]] = {k: [] for k in CASES}
        for _ in range(reps):
            for k in CASES:
                t0 = time.perf_counter()
                _call(guards[k], *data[k])
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in CASES:
            ratios[k].append(med[k] / med["aligned"])
    logging.disable(logging.NOTSET)
    return ratios


def run(quick: bool = False) -> list[dict]:
    b, s, h, runs = sizes(quick)
    shape = f"CPU b={b} s={s} h={h} bf16, {runs} runs/row"
    rows: list[dict] = []
    for case in CASES:
        vals = [_memory_in_subprocess(case, quick) for _ in range(2)]
        got = [v for v in vals if v is not None]
        limit = MEM_TARGET.get(case)
        rows.append(
            {
                "benchmark": "fault-path memory",
                "metric": f"{case}: peak RSS above the call's start / embeddings",
                "value": max(got) if got else float("nan"),
                "target": f"<= {limit:g}" if limit else "info",
                "note": f"{shape}; fresh process per run, max of {len(got)} "
                + ", ".join(f"{v:.3f}" for v in got),
            }
        )
    ratios = time_ratios(quick, 1 if quick else 5)
    for case in list(CASES)[1:]:
        r = ratios[case]
        limit = TIME_TARGET.get(case)
        rows.append(
            {
                "benchmark": "fault-path time",
                "metric": f"{case} / aligned merge",
                "value": statistics.median(r),
                "target": f"<= {limit:g}" if limit else "info",
                "note": f"median of {len(r)} rounds, range {min(r):.2f}-{max(r):.2f}",
            }
        )
    return rows


if __name__ == "__main__":
    if "--mem" in sys.argv:
        case = sys.argv[sys.argv.index("--mem") + 1]
        print(json.dumps(measure_memory(case, "--quick" in sys.argv)))
        sys.exit(0)
    for row in run("--quick" in sys.argv):
        print(row)
