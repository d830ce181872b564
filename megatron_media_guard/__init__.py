"""megatron_media_guard: per-sample, per-rank guard for merging media features into text
embeddings in Megatron vision-language training.

Public surface::

    guard = MediaGuard(GuardConfig(policy="drop", log_dir="logs"), grammar=Grammar.qwen2_vl())
    res = guard.merge(embeddings, input_ids, features, items=items, loss_mask=lm, labels=labels)
    res.embeddings, res.loss_mask, res.labels, res.report

The names below load on first use (PEP 562), so ``import megatron_media_guard`` and the
torch-free parts (``diagnostics``, ``media-guard report``, ``--help``) do not import torch.
The pipeline and the import rules: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "AlignmentReport": ".core.alignment",
    "SampleReport": ".core.alignment",
    "Status": ".core.alignment",
    "check_alignment": ".core.alignment",
    "GuardConfig": ".config",
    "GuardRecord": ".diagnostics.records",
    "RankInfo": ".diagnostics.records",
    "ConsensusError": ".errors",
    "DropBudgetExceeded": ".errors",
    "MediaAlignmentError": ".errors",
    "MediaInputError": ".errors",
    "Grammar": ".core.grammar",
    "MediaItem": ".core.items",
    "MediaGuard": ".core.guard",
    "GuardReport": ".core.outcome",
    "MergeResult": ".core.outcome",
    "Finding": ".core.runs",
    "FindingKind": ".core.runs",
    "ParsedRuns": ".core.runs",
    "Run": ".core.runs",
    "parse_runs": ".core.runs",
}

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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .config import GuardConfig
    from .core.alignment import AlignmentReport, SampleReport, Status, check_alignment
    from .core.grammar import Grammar
    from .core.guard import MediaGuard
    from .core.items import MediaItem
    from .core.outcome import GuardReport, MergeResult
    from .core.runs import Finding, FindingKind, ParsedRuns, Run, parse_runs
    from .diagnostics.records import GuardRecord, RankInfo
    from .errors import ConsensusError, DropBudgetExceeded, MediaAlignmentError, MediaInputError
