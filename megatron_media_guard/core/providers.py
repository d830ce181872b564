"""What the core calls but never imports (not even inside a function), registered from above
when imported and looked up when used: ``ranks/defaults.py`` the rank and default consensus,
``replay/bundle_save.py`` the replay-bundle writer (who imports them: docs/ARCHITECTURE.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..diagnostics import RankInfo, get_logger
from .outcome import Consensus


@dataclass(frozen=True)
class ProcessDefaults:
    """rank: asked at each record; consensus: asked until not None (torch.distributed up)."""

    rank: Callable[[], RankInfo]
    consensus: Callable[[], Consensus | None]


_PROVIDED: dict[str, object] = {}  # "process": ProcessDefaults, "bundle": the writer, "warned"


def provide_process(defaults: ProcessDefaults) -> None:
    _PROVIDED["process"] = defaults


def provide_bundle_writer(write: Callable[..., object]) -> None:
    _PROVIDED["bundle"] = write


def process_rank() -> RankInfo:
    defaults = _PROVIDED.get("process")
    return defaults.rank() if isinstance(defaults, ProcessDefaults) else RankInfo.from_env()


def default_consensus() -> Consensus | None:
    """The default consensus (None before torch.distributed is up, or without ``ranks/``:
    then a warning, once, when ``WORLD_SIZE`` > 1)."""
    defaults = _PROVIDED.get("process")
    if isinstance(defaults, ProcessDefaults):
        return defaults.consensus()
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if world > 1 and "warned" not in _PROVIDED:
        _PROVIDED["warned"] = True
        get_logger().warning(
            "[media-guard] WORLD_SIZE=%s but no default consensus is registered (only "
            "megatron_media_guard.core was imported): every guard decides alone. Build guards "
            "through megatron_media_guard.MediaGuard or an adapter, import "
            "megatron_media_guard.ranks, or pass consensus= / consensus=False",
            os.environ.get("WORLD_SIZE"),
        )
    return None


def bundle_writer() -> Callable[..., object] | None:
    write = _PROVIDED.get("bundle")
    return write if callable(write) else None
