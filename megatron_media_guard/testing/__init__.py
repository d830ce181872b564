"""Helpers for tests and benchmarks: the synthetic fault batches (re-exported from
``smoke.faults``, which the smoke job also uses) and the per-token reference parser.

May import anything in the package; nothing in the runtime imports this package.
"""

from ..smoke.faults import (
    FAULTS,
    PAD_ID,
    TEST_GRAMMARS,
    TEXT_HIGH,
    TEXT_LOW,
    SyntheticBatch,
    build_batch,
    inject,
    random_layout,
)
from .reference import reference_runs

__all__ = [
    "FAULTS",
    "PAD_ID",
    "TEST_GRAMMARS",
    "TEXT_HIGH",
    "TEXT_LOW",
    "SyntheticBatch",
    "build_batch",
    "inject",
    "random_layout",
    "reference_runs",
]
