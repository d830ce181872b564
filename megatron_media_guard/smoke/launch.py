"""Start the smoke ranks with torch's elastic launcher, under a hard timeout.

``elastic_launch`` (the machinery behind ``torchrun``) starts ``nproc`` local workers with a
c10d rendezvous on 127.0.0.1 (a free port), no restarts. Workers are forked from a
``forkserver`` that imports torch, megatron-core and the guard once (seconds saved per rank).

Hard timeout: a timer sends SIGUSR1 to this process after ``timeout`` seconds; the elastic
agent turns it into a ``SignalException``, stops every worker and we report a hang. The
agent installs its signal handlers only from the main thread, so ``launch`` must run there;
the previous handlers are restored afterwards.

Start methods: ``forkserver`` (default) or ``spawn``, never ``fork``. The launching process is
threaded by the time workers start (the timer above, plus whatever threads the caller runs:
pytest, torch's intra-op pool), and a child forked from a threaded process can inherit a lock
held mid-operation by a thread that does not exist in the child: it hangs or crashes (SIGSEGV).
The forkserver is itself started by fork+exec and is single-threaded, so forking from it is safe.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch.multiprocessing as tmp
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .runspec import RankResult, WorkerArgs

PRELOAD = ("torch.distributed", "megatron_media_guard.smoke.worker")
_HANDLED = ("SIGTERM", "SIGINT", "SIGUSR1")

StartMethod = Literal["forkserver", "spawn"]


class LaunchError(RuntimeError):
    """A rank failed, or the run did not finish within its timeout (``timed_out``)."""

    def __init__(self, message: str, *, timed_out: bool = False, interrupted: bool = False):
        super().__init__(message)
        self.timed_out = timed_out
        self.interrupted = interrupted


@dataclass(frozen=True)
class LaunchSpec:
    """nproc local ranks; timeout_s: hard limit for the whole launch (start included).

    launcher_log_dir: where torchelastic keeps its per-attempt error files (None: a temp dir).
    start_method / preload: how workers start (``forkserver`` preloading ``preload``, or
    ``spawn``); ``fork`` is refused (unsafe from the launcher's threaded process, see above).
    ``entry`` and its arguments are pickled by name: they must be module-level.
    """

    nproc: int
    timeout_s: float
    launcher_log_dir: str | None = None
    start_method: StartMethod = "forkserver"
    preload: tuple[str, ...] = PRELOAD

    def __post_init__(self) -> None:
        if self.start_method not in get_args(StartMethod):
            raise LaunchError(
                f"start_method {self.start_method!r} is not one of {get_args(StartMethod)}: "
                "forking a threaded launcher can hang or crash its workers"
            )


def rank_entry(args: WorkerArgs) -> RankResult:
    """The workers' entry point (the elastic agent wraps it in ``record``: a failure's
    traceback lands in its error file); imports the worker (megatron-core) in the rank only, so the
    launching process stays light (the forkserver has it preloaded)."""
    from .worker import rank_main

    return rank_main(args)


def _raise_signal(signum: int, frame: object) -> None:
    raise SignalException(
        f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum)
    )


def launch(spec: LaunchSpec, args: WorkerArgs, entry: Callable[..., Any] = rank_entry) -> list:
    """``entry(args)`` on ``spec.nproc`` ranks (default: :func:`worker.rank_main`); the results
    ordered by rank (each entry's result must have a ``rank`` attribute)."""
    if threading.current_thread() is not threading.main_thread():
        raise LaunchError("the smoke launcher must run in the main thread (signal handling)")
    if spec.start_method == "forkserver" and spec.preload:
        tmp.get_context("forkserver").set_forkserver_preload(list(spec.preload))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=spec.nproc,
        run_id=f"media-guard-smoke-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.05,
        start_method=spec.start_method,
        signals_to_handle=",".join(_HANDLED),
        logs_specs=DefaultLogsSpecs(log_dir=spec.launcher_log_dir),
    )
    saved = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED}
    fired = threading.Event()

    def alarm() -> None:
        fired.set()
        os.kill(os.getpid(), signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, _raise_signal)  # until the agent installs its own
    timer = threading.Timer(spec.timeout_s, alarm)
    timer.daemon = True
    timer.start()
    try:
        results = elastic_launch(config, entry)(args)
    except SignalException as exc:
        if fired.is_set():
            raise LaunchError(
                f"timed out after {spec.timeout_s:g} s: the ranks did not finish (a hang or too "
                "slow); every worker was stopped",
                timed_out=True,
            ) from None
        raise LaunchError(f"interrupted ({exc})", interrupted=True) from None
    except ChildFailedError as exc:
        raise LaunchError(_failure_text(exc)) from None
    finally:
        timer.cancel()
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)
    out = sorted(results.values(), key=lambda r: r.rank)
    if len(out) != spec.nproc:
        raise LaunchError(f"{len(out)} of {spec.nproc} ranks returned a result")
    return out


def _failure_text(exc: ChildFailedError) -> str:
    lines = ["a rank failed:"]
    for rank, failure in sorted(exc.failures.items()):
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
            if isinstance(msg, dict):
                msg = msg.get("message", "")
        lines.append(f"  rank {rank} (exit code {failure.exitcode}): {msg}")
    return "\n".join(lines)
