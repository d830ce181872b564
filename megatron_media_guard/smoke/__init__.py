"""``media-guard smoke``: a distributed smoke run of the guard with fault injection.

Launches N ranks (4 CPU ranks over gloo by default) with torch's elastic launcher; each
builds megatron-core ``parallel_state`` and a tiny VLM (megatron-core language embedding and
projector, torch vision tower and decoder), wraps the merge in a :class:`MediaGuard` with
stage consensus, and trains a few steps per scenario x policy on a synthetic image + video
stream where one named fault lands on one rank at one step. It ends with the post-mortem
summary of the per-rank JSONL files and a table of expected vs observed outcomes.

Exit codes: 0 every scenario ended as expected; 1 a mismatch (listed); 2 usage error;
4 the launch failed (a rank crashed, or the run hit ``--timeout``); 130 interrupted.

Top of the stack: may import everything in the package, torch.distributed and megatron-core
(checked up front, imported in the ranks). ``faults`` (the synthetic fault batches) is also
what tests and benchmarks use, through ``megatron_media_guard.testing``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .names import DEFAULT_POLICIES, POLICIES
from .names import FAULTS as SCENARIOS

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_LAUNCH = 4
EXIT_INTERRUPTED = 130

__all__ = ["EXIT_LAUNCH", "EXIT_MISMATCH", "EXIT_OK", "add_smoke_arguments", "main", "run_smoke"]


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if names == ["all"]:
            return allowed
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad or [text]}; choose from {', '.join(allowed)} or all"
            )
        return tuple(dict.fromkeys(names))

    return parse


def add_smoke_arguments(p: argparse.ArgumentParser) -> None:
    """The ``media-guard smoke`` flags."""
    p.add_argument(
        "--scenario",
        type=_names(SCENARIOS, "scenario"),
        default=SCENARIOS,
        metavar="NAME[,NAME]|all",
        help=f"fault scenarios to run (default all: {', '.join(SCENARIOS)})",
    )
    p.add_argument(
        "--policy",
        type=_names(POLICIES, "policy"),
        default=DEFAULT_POLICIES,
        metavar="raise|drop|repair|all",
        help="guard policies to run each scenario under (comma list; default raise,drop)",
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks to launch (default 4)")
    p.add_argument("--steps", type=int, default=3, help="training steps per scenario (default 3)")
    p.add_argument(
        "--log-dir", default=None, help="diagnostics directory (default: a fresh temp dir)"
    )
    p.add_argument(
        "--dump-dir",
        default=None,
        help="save a replay bundle of each mismatched micro-batch under DIR/<scenario>.<policy>/ "
        "(for `media-guard replay`; default: none)",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size (default 1; DP = nproc / tp)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="hard limit for the whole run in seconds (default 300)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="default auto: nccl when every rank can have its own GPU, else gloo on CPU",
    )
    p.add_argument(
        "--fault-rank",
        type=int,
        default=None,
        help="global rank that gets the faulty micro-batch (default 1, or 0 with one rank)",
    )
    p.add_argument(
        "--fault-step",
        type=int,
        default=None,
        help="step the fault lands at (default 1, or 0 with one step)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic media stream")
    p.add_argument(
        "--verbose", action="store_true", help="print the guard's per-rank log lines too"
    )
    p.add_argument("--hang-rank", type=int, default=None, help=argparse.SUPPRESS)


def _usage(msg: str) -> int:
    print(f"media-guard smoke: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _backend(choice: str, nproc: int) -> str:
    if choice != "auto":
        return choice
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"


def run_smoke(args: argparse.Namespace) -> int:
    """Run the smoke job described by parsed ``args``; returns the exit code."""
    from .runspec import WorkerArgs

    n, steps, tp = args.nproc, args.steps, args.tp
    if n < 1 or steps < 1 or tp < 1 or n % tp:
        return _usage(
            f"need --nproc >= 1, --steps >= 1 and --tp dividing --nproc (got {n}, {steps}, {tp})"
        )
    fault_rank = min(1, n - 1) if args.fault_rank is None else args.fault_rank
    fault_step = min(1, steps - 1) if args.fault_step is None else args.fault_step
    if not 0 <= fault_rank < n or not 0 <= fault_step < steps:
        return _usage(f"--fault-rank must be in [0, {n}) and --fault-step in [0, {steps})")
    if args.timeout <= 0:
        return _usage("--timeout must be > 0")
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        return _usage("needs megatron-core (pip install -e '.[megatron]')")
    backend = _backend(args.backend, n)
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < n:
            return _usage(f"--backend nccl needs {n} GPUs, found {torch.cuda.device_count()}")
    if args.log_dir:
        log_dir = Path(args.log_dir)
        bad = _unusable_dir(log_dir)
        if bad:
            return _usage(f"--log-dir {log_dir}: {bad}")
    else:  # removed at the end unless the run failed (then kept for the post-mortem)
        log_dir = Path(tempfile.mkdtemp(prefix="media_guard_smoke_"))
    dump_dir = None
    if args.dump_dir:
        dump_dir = Path(args.dump_dir)
        bad = _unusable_dir(dump_dir)
        if bad:
            return _usage(f"--dump-dir {dump_dir}: {bad}")
    runs = [f"{s}.{p}" for s in args.scenario for p in args.policy]
    used = [r for r in runs if any((log_dir / r).glob("media_guard.rank*.jsonl"))]
    if used:
        return _usage(f"{log_dir} already holds diagnostics for {used[:3]}: use a fresh --log-dir")
    wargs = WorkerArgs(
        scenarios=tuple(args.scenario),
        policies=tuple(args.policy),
        steps=steps,
        log_dir=str(log_dir),
        tp=tp,
        fault_rank=fault_rank,
        fault_step=fault_step,
        backend=backend,
        pg_timeout_s=max(30.0, min(120.0, args.timeout / 3)),
        seed=args.seed,
        verbose=args.verbose,
        hang_rank=args.hang_rank,
        dump_dir=None if dump_dir is None else str(dump_dir),
    )
    print(
        f"media-guard smoke: {n} ranks ({backend}), TP{tp} DP{n // tp}, steps 0..{steps - 1} per run; "
        f"fault on rank {fault_rank} at step {fault_step}\n"
        f"  scenarios: {', '.join(args.scenario)}\n  policies:  {', '.join(args.policy)}\n"
        f"  log dir:   {log_dir}"
        + (f"\n  dump dir:  {dump_dir} (replay bundles)" if dump_dir is not None else ""),
        flush=True,
    )
    from .scenarios import FAULT_SPECS  # torch: only once the run starts

    for s in args.scenario:
        print(f"  - {s}: {FAULT_SPECS[s].what}", flush=True)
    code = EXIT_INTERRUPTED
    try:
        code = _launch_and_check(wargs, n, args.timeout, log_dir, temporary=not args.log_dir)
    finally:
        if not args.log_dir:
            _drop_temp_dir(log_dir, code)
    return code


def _unusable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be the log directory (created here when missing), else None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "exists and is not a directory"
    except OSError as err:
        return f"cannot create it ({err.strerror or type(err).__name__})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def _drop_temp_dir(log_dir: Path, code: int) -> None:
    """The default (temporary) log directory: removed after a run that passed or was cut
    short by the user; kept, and named, after a failure."""
    if code in (EXIT_OK, EXIT_INTERRUPTED):
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        print(f"  (temporary log dir kept for the post-mortem: {log_dir}; remove it when done)")


def _launch_and_check(
    wargs, nproc: int, timeout: float, log_dir: Path, *, temporary: bool = False
) -> int:
    from .launch import LaunchError, LaunchSpec, launch
    from .verify import check_runs

    t0 = time.perf_counter()
    try:
        results = launch(LaunchSpec(nproc, timeout, str(log_dir / "launcher")), wargs)
    except LaunchError as err:
        print(f"media-guard smoke: FAILED: {err}", file=sys.stderr, flush=True)
        print(f"  diagnostics so far: {log_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED if err.interrupted else EXIT_LAUNCH
    ok, text = check_runs(wargs, results, log_dir)
    if ok and temporary:  # the page goes with the temporary logs: never point at a removed file
        text = "\n".join(
            "post-mortem page: written, and removed with the temporary logs"
            if line.startswith("post-mortem page: file://")
            else line
            for line in text.splitlines()
        )
    print(text)
    hint = (
        f"post-mortem: media-guard report {log_dir} (all runs) or {log_dir}/<scenario>.<policy>"
        if not (ok and temporary)
        else "pass --log-dir DIR to keep the per-rank logs and the post-mortem page"
    )
    print(
        f"\nmedia-guard smoke: {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s; "
        + hint,
        flush=True,
    )
    return EXIT_OK if ok else EXIT_MISMATCH


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_media_guard.smoke [flags]``."""
    parser = argparse.ArgumentParser(
        prog="media-guard smoke", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    add_smoke_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    try:
        return run_smoke(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
