"""One entry point for every benchmark: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each ``bench_*`` module exposes ``run(quick) -> list[dict]``; rows are printed as one
table (ratios are measured within one run, both sides interleaved where it matters).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import platform
import sys
import time
from pathlib import Path

import torch


def _modules() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def _machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"{dev}; Python {platform.python_version()}, torch {torch.__version__}"
    )


def result(value: float, target: str) -> str:
    """``pass`` / ``miss`` for a numeric target (``<= 1.05``, ``>= 10``, ``< 0.5``), else ``-``."""
    parts = target.split()
    if len(parts) < 2 or parts[0] not in ("<=", ">=", "<", ">"):
        return "-"
    try:
        limit = float(parts[1].rstrip(",x"))
    except ValueError:
        return "-"
    ok = {"<=": value <= limit, ">=": value >= limit, "<": value < limit, ">": value > limit}
    return "pass" if ok[parts[0]] else "miss"


def format_table(rows: list[dict]) -> str:
    head = ("benchmark", "metric", "value", "target", "result", "note")
    cells = [head] + [
        (
            r["benchmark"],
            r["metric"],
            f"{r['value']:.3g}",
            r["target"],
            result(r["value"], r["target"]),
            r.get("note", ""),
        )
        for r in rows
    ]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(head) - 1)]
    lines = []
    for k, c in enumerate(cells):
        lines.append(
            "| " + " | ".join(str(x).ljust(w) for x, w in zip(c, widths)) + f" | {c[-1]} |"
        )
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|---|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps (a sanity run)")
    ap.add_argument("--only", nargs="*", default=None, help="module names, e.g. bench_merge")
    ap.add_argument("--json", action="store_true", help="print rows as JSON lines too")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    for name in _modules():
        if args.only and name not in args.only and name.removeprefix("bench_") not in args.only:
            continue
        t0 = time.perf_counter()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        mod = importlib.import_module(f"benchmarks.{name}")
        rows += mod.run(quick=args.quick)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(f"Machine: {_machine()}\n")
    print(format_table(rows))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
