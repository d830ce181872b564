"""What crosses the launcher: the arguments every rank runs with and what each rank reports.

Kept free of megatron imports so the launching process stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerArgs:
    """What every rank runs (picklable: it crosses the launcher)."""

    scenarios: tuple[str, ...]
    policies: tuple[str, ...]
    steps: int
    log_dir: str
    tp: int = 1
    fault_rank: int = 1
    fault_step: int = 1
    backend: str = "gloo"
    pg_timeout_s: float = 60.0
    seed: int = 0
    lr: float = 0.05
    verbose: bool = False
    hang_rank: int | None = None  # testing the launcher's timeout: this rank sleeps forever
    dump_dir: str | None = None  # replay bundles of mismatched micro-batches, per run


@dataclass(frozen=True)
class Observation:
    """What one rank saw in one scenario x policy run.

    drops / repairs: (step, samples dropped) / (step, items repaired) as the merge reported.
    injected: (step, faulty samples) this rank fed. raised_step None: no error.
    culprit: the rank the error named (its own rank when it is the culprit).
    """

    scenario: str
    policy: str
    rank: int
    steps_done: int
    losses: tuple[float, ...]
    drops: tuple[tuple[int, tuple[int, ...]], ...]
    repairs: tuple[tuple[int, tuple[int, ...]], ...]
    injected: tuple[tuple[int, tuple[int, ...]], ...]
    raised_step: int | None = None
    error_type: str | None = None
    error: str | None = None
    culprit: int | None = None
    names_culprit: bool = False
    in_sync: bool = True
    seconds: float = 0.0

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in self.losses)


@dataclass(frozen=True)
class RankResult:
    rank: int
    tp: int
    dp: int
    world: int
    device: str
    observations: tuple[Observation, ...]
