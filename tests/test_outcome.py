"""``LocalOutcome.of_plan``: a planned call's outcome, counted from its final plan."""

from __future__ import annotations

import pytest

from megatron_media_guard.core.outcome import LocalOutcome
from megatron_media_guard.core.plan import ItemRepair, Plan

REPAIR = ItemRepair(item=1, sample=1, target=4, run=0)


@pytest.mark.parametrize(
    "plan, kw, want",
    [
        (
            Plan(("keep", "keep"), (), 11),
            {},
            dict(digest=11, num_samples=2, mismatched=0, dropped=0, repaired=0, fatal=False),
        ),
        (
            Plan(("drop", "repair", "keep"), (REPAIR,), 12),
            dict(mismatched=2),
            dict(digest=12, num_samples=3, mismatched=2, dropped=1, repaired=1, fatal=False),
        ),
        (
            Plan(("keep", "raise", "raise"), (), 13),
            dict(mismatched=2, message="boom", record={"event": "raise"}),
            dict(
                digest=13,
                num_samples=3,
                mismatched=2,
                dropped=0,
                repaired=0,
                fatal=True,
                fatal_sample=1,
                message="boom",
                record={"event": "raise"},
            ),
        ),
        (  # a batch-level fatal (a message, no raising sample): fatal, no sample named
            Plan(("drop",), (), 14),
            dict(message="orphans"),
            dict(digest=14, dropped=1, fatal=True, fatal_sample=None, message="orphans"),
        ),
    ],
)
def test_of_plan_counts_the_plan(plan, kw, want):
    out = LocalOutcome.of_plan(plan, 7, 3, **kw)
    assert (out.step, out.microbatch) == (7, 3)
    got = {k: getattr(out, k) for k in want}
    assert got == want
    if not out.fatal:
        assert out.fatal_sample is None and out.message is None and out.record is None
