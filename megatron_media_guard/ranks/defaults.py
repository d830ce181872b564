"""What a :class:`~megatron_media_guard.core.guard.MediaGuard` built without ``consensus=`` or
``rank=`` gets, registered with ``core/providers.py`` when imported (the core never imports
this module): a :class:`~.consensus.StageConsensus` over ``parallel_state``'s groups, else the
world group (None without torch.distributed), and :func:`~.consensus.process_rank_info`, both
resolved when used (docs/CONSENSUS.md, "The default").
"""

from __future__ import annotations

import threading

from ..core.providers import ProcessDefaults, provide_process
from ..diagnostics import RankInfo, get_logger
from .consensus import StageConsensus, dist_ready, parallel_state, process_rank_info

_ANNOUNCED: set[str] = set()
_LOCK = threading.Lock()


def default_consensus() -> StageConsensus | None:
    if not dist_ready():
        return None
    if parallel_state() is not None:
        cons, source = StageConsensus.from_parallel_state(), "megatron-core parallel_state"
    else:
        cons, source = StageConsensus(), "the world group (parallel_state is not initialized)"
    with _LOCK:  # once per process and source
        first = source not in _ANNOUNCED
        _ANNOUNCED.add(source)
    if first:
        get_logger().info(
            "[media-guard] torch.distributed is initialized: every guarded merge is agreed over "
            "%s, stage of %d rank(s); pass consensus=False to decide per rank alone",
            source,
            cons.stage_size,
        )
    return cons


class ProcessRank:
    """``process_rank_info()``, recomputed only when torch.distributed or parallel_state
    became initialized since the last call."""

    def __init__(self) -> None:
        self._key: tuple[bool, bool] | None = None
        self._info = RankInfo()

    def __call__(self) -> RankInfo:
        key = (dist_ready(), parallel_state() is not None)
        if key != self._key:
            self._info, self._key = process_rank_info(), key
        return self._info


# one ProcessRank for the process: its cache follows torch.distributed / parallel_state
provide_process(ProcessDefaults(rank=ProcessRank(), consensus=default_consensus))
