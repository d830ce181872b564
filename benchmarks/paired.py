"""The merge's fixed cost of two source trees in one process, interleaved.

On a shared 2-core machine the same code reads 1.5-2x apart from one minute to the next, so
figures from two runs cannot show a 10-20 % change. This loads a second checkout (``--old``,
e.g. ``git worktree add /tmp/base <rev>``) next to this one and times both guards call by
call, so both see the same machine state.

Run: ``python -m benchmarks.paired --old /tmp/base [--shape 4 1024 128] [--reps 150]``.
Prints, per tree, the guard, its own scatter and their difference (ms per call, CPU time of
one thread, median of the reps, 10 calls each).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.bench_merge import cpu_ms_per_call

_PACKAGES = ("megatron_media_guard", "benchmarks")


def _load(root: str) -> dict:
    """Imports the package from ``root`` and detaches its modules from ``sys.modules``, so
    that the next tree imports afresh (each guard keeps references to its own modules)."""
    for name in [k for k in sys.modules if k.split(".")[0] in _PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        from benchmarks.bench_merge import G, _batch
        from megatron_media_guard import GuardConfig, MediaGuard
        from megatron_media_guard.core.apply import scatter
        from megatron_media_guard.diagnostics import RankInfo
    finally:
        sys.path.remove(root)
    return {
        "G": G,
        "batch": _batch,
        "guard": lambda: MediaGuard(
            GuardConfig(), grammar=G, rank=RankInfo(rank=0), consensus=False
        ),
        "scatter": scatter,
    }


def _calls(env: dict, b: int, s: int, h: int) -> dict:
    batch = env["batch"](b, s, 4)
    ids = batch.input_ids
    emb = torch.randn(b, s, h, dtype=torch.bfloat16)
    feats = torch.randn(sum(it.num_features for it in batch.items), h, dtype=torch.bfloat16)
    guard, scatter, pad = env["guard"](), env["scatter"], env["G"].placeholders["image"]
    return {
        "guard": lambda: guard.merge(emb, ids, feats, batch.items),
        "scatter": lambda: scatter(emb, ids == pad, feats),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the other checkout's root")
    ap.add_argument("--shape", type=int, nargs=3, default=(4, 1024, 128), metavar=("B", "S", "H"))
    ap.add_argument("--reps", type=int, default=150)
    args = ap.parse_args(argv)
    here = str(Path(__file__).resolve().parents[1])
    fns = {}
    for name, root in (("old", str(Path(args.old).resolve())), ("new", here)):
        for k, fn in _calls(_load(root), *args.shape).items():
            fns[f"{name} {k}"] = fn
    med = cpu_ms_per_call(fns, args.reps, warmup=30)
    b, s, h = args.shape
    print(f"b={b} s={s} h={h} bf16, ms per call (CPU time, 1 thread, median of {args.reps})")
    for name in ("old", "new"):
        g, sc = med[f"{name} guard"], med[f"{name} scatter"]
        print(f"  {name}: guard {g:.3f}  its scatter {sc:.3f}  guard - scatter {g - sc:.3f}")


if __name__ == "__main__":
    main()
