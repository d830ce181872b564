"""Run a function on N gloo ranks on CPU, with a hard bound: a hang is a failure.

``run_ranks(fn, 4, args=...)`` forks 4 processes from a ``forkserver`` that imported torch,
megatron-core and the guard once, initializes a gloo group over a file store, and returns
``[fn(rank, world_size, *args) for each rank]``. An exception in any rank fails the call
with every failed rank's traceback (first failure first); a rank still running after
``timeout`` seconds is a hang: every process is killed and the unfinished ranks are named.
Collectives time out after ``pg_timeout`` seconds. ``late_init=True``: no process group or
``RANK``/``WORLD_SIZE`` at start; ``fn(rank, world_size, init, *args)`` calls ``init()``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as tmp

PRELOAD = [
    "torch.distributed",
    "megatron_media_guard.ranks.consensus",
    "megatron.core.parallel_state",
]
START_METHOD = os.environ.get("MEDIA_GUARD_TEST_START_METHOD", "forkserver")


def _rank_main(
    rank: int,
    world: int,
    workdir: str,
    fn: Callable[..., Any],
    args: tuple,
    pg_timeout: float,
    late_init: bool = False,
) -> None:
    import functools
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init = functools.partial(_init_group, rank, world, workdir, pg_timeout)
    if late_init:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(name, None)
    else:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        init()
    try:
        result = fn(rank, world, init, *args) if late_init else fn(rank, world, *args)
        with open(Path(workdir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        # time-stamped, so the parent can name the first failure (the others often follow it)
        (Path(workdir) / f"error{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_group(rank: int, world: int, workdir: str, pg_timeout: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 4,
    *,
    args: tuple = (),
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    late_init: bool = False,
) -> list[Any]:
    """(The module's docstring.) ``fn`` is pickled by name: a module-level function."""
    if START_METHOD == "forkserver":
        tmp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="media_guard_dist_") as workdir:
        ctx = tmp.start_processes(
            _rank_main,
            args=(world_size, workdir, fn, args, pg_timeout, late_init),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    raise AssertionError(
                        f"ranks {hung} of {world_size} still running after {timeout:.0f} s: "
                        "a hang (all processes killed)"
                    )
        except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as exc:
            raise AssertionError(_failures(workdir, world_size) or str(exc)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for r in range(world_size):
            with open(Path(workdir) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _failures(workdir: str, world_size: int) -> str:
    """Every rank's traceback, first failure first."""
    found = []
    for r in range(world_size):
        path = Path(workdir) / f"error{r}.txt"
        if path.exists():
            stamp, _, text = path.read_text().partition("\n")
            found.append((float(stamp), r, text))
    found.sort()
    return "".join(
        f"\n-- rank {r} failed{' first' if i == 0 else ''}:\n{text}"
        for i, (_, r, text) in enumerate(found)
    )


def data_parallel(model, layout: str, shard=()) -> tuple[Any, Any]:
    """(wrapped, inner): ``model`` under DDP (``find_unused_parameters=False``) or FSDP2 over
    every rank, NeMo-RL's per-module layout (``fully_shard`` on each of ``shard``, then the
    root)."""
    import torch

    if layout == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        return wrapped, wrapped.module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in shard:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def full_grads(params: dict) -> dict:
    """Each parameter's whole gradient (None where it has none): FSDP2's shards are gathered,
    a collective, in the same order on every rank."""
    return {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in params.items()
    }
