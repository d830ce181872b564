"""``LocalOutcome.of_plan``: a planned call's outcome, counted from its final plan."""

from __future__ import annotations

import pytest

from megatron_media_guard.core.outcome import LocalOutcome
from megatron_media_guard.core.plan import ItemRepair, Plan

REPAIR = ItemRepair(item=1, sample=1, target=4, run=0)
COUNTED = ("digest", "num_samples", "mismatched", "dropped", "repaired", "fatal", "fatal_sample")
RAISED = dict(mismatched=2, message="boom", record={"event": "raise"})


@pytest.mark.parametrize(
    "plan, kw, want",  # want: the COUNTED fields
    [
        (Plan(("keep", "keep"), (), 11), {}, (11, 2, 0, 0, 0, False, None)),
        (
            Plan(("drop", "repair", "keep"), (REPAIR,), 12),
            {"mismatched": 2},
            (12, 3, 2, 1, 1, False, None),
        ),
        (Plan(("keep", "raise", "raise"), (), 13), RAISED, (13, 3, 2, 0, 0, True, 1)),
        # a batch-level fatal (a message, no raising sample): fatal, no sample named
        (Plan(("drop",), (), 14), {"message": "orphans"}, (14, 1, 0, 1, 0, True, None)),
    ],
)
def test_of_plan_counts_the_plan(plan, kw, want):
    out = LocalOutcome.of_plan(plan, 7, 3, **kw)
    assert (out.step, out.microbatch) == (7, 3)
    assert tuple(getattr(out, k) for k in COUNTED) == want
    assert (out.message, out.record) == (kw.get("message"), kw.get("record"))
