"""What the core calls but does not own, handed in from above (the core never imports the
owners, not even inside a function: tests/test_layout.py); each registers when imported:
``ranks/defaults.py`` the rank coordinates and default consensus (:func:`provide_process`),
``replay/bundle_save.py`` the replay-bundle writer (:func:`provide_bundle_writer`).

The package ``__init__`` (a torch-side public name), ``adapters/__init__.py``, the smoke worker
and any import of ``ranks/`` import both. A guard whose module was imported alone is
single-process: its rank from ``RANK``, no consensus (a warning when ``WORLD_SIZE`` > 1), no
bundle (one error line when ``dump_dir`` asks for one). Both are looked up when used, so
importing them later still counts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..diagnostics import RankInfo, get_logger
from .outcome import Consensus


@dataclass(frozen=True)
class ProcessDefaults:
    """rank: this process's coordinates, asked at each record; consensus: the default one,
    asked until it is not None (None: torch.distributed not initialized)."""

    rank: Callable[[], RankInfo]
    consensus: Callable[[], Consensus | None]


_PROVIDED: dict[str, object] = {}  # "process": ProcessDefaults, "bundle": the writer, "warned"


def provide_process(defaults: ProcessDefaults) -> None:
    """Registers the process defaults (``ranks/defaults.py`` does, when imported)."""
    _PROVIDED["process"] = defaults


def provide_bundle_writer(write: Callable[..., object]) -> None:
    """Registers the replay-bundle writer (``replay/bundle_save.py`` does, when imported)."""
    _PROVIDED["bundle"] = write


def process_rank() -> RankInfo:
    """This process's rank coordinates (without ``ranks/``: ``RANK`` from the environment)."""
    defaults = _PROVIDED.get("process")
    return defaults.rank() if isinstance(defaults, ProcessDefaults) else RankInfo.from_env()


def default_consensus() -> Consensus | None:
    """The default consensus, None while torch.distributed is not initialized (or without
    ``ranks/``: then a warning, once, in a job of more than one process)."""
    defaults = _PROVIDED.get("process")
    if isinstance(defaults, ProcessDefaults):
        return defaults.consensus()
    if _world_size() > 1 and "warned" not in _PROVIDED:
        _PROVIDED["warned"] = True
        get_logger().warning(
            "[media-guard] WORLD_SIZE=%s but no default consensus is registered (only "
            "megatron_media_guard.core was imported): every guard decides alone. Build guards "
            "through megatron_media_guard.MediaGuard or an adapter, import "
            "megatron_media_guard.ranks, or pass consensus= / consensus=False",
            os.environ.get("WORLD_SIZE"),
        )
    return None


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def bundle_writer() -> Callable[..., object] | None:
    """``replay.bundle_save.save_bundle`` once ``replay/`` registered it, else None."""
    write = _PROVIDED.get("bundle")
    return write if callable(write) else None
