"""megatron_media_guard: per-sample, per-rank guard for merging media features into text
embeddings in Megatron vision-language training.

Public surface::

    guard = MediaGuard(GuardConfig(policy="drop", log_dir="logs"), grammar=Grammar.qwen2_vl())
    res = guard.merge(embeddings, input_ids, features, items=items, loss_mask=lm, labels=labels)
    res.embeddings, res.loss_mask, res.labels, res.report
"""

from .alignment import AlignmentReport, SampleReport, Status, check_alignment
from .config import GuardConfig
from .diagnostics import GuardRecord, RankInfo
from .errors import ConsensusError, DropBudgetExceeded, MediaAlignmentError, MediaInputError
from .grammar import Grammar
from .items import MediaItem
from .merge import MediaGuard
from .outcome import GuardReport, MergeResult
from .runs import Finding, FindingKind, ParsedRuns, Run, parse_runs

__version__ = "0.1.0"

__all__ = [
    "AlignmentReport",
    "ConsensusError",
    "DropBudgetExceeded",
    "Finding",
    "FindingKind",
    "Grammar",
    "GuardConfig",
    "GuardRecord",
    "GuardReport",
    "MediaAlignmentError",
    "MediaGuard",
    "MediaInputError",
    "MediaItem",
    "MergeResult",
    "ParsedRuns",
    "RankInfo",
    "Run",
    "SampleReport",
    "Status",
    "__version__",
    "check_alignment",
    "parse_runs",
]
