"""The records the fault path writes for a plan: one per dropped or raised sample, in sample
order, and ``check`` records for what no sample's decision covers (shared by MediaGuard.merge
and the Qwen-VL adapter, which differ only in wording and extras)."""

from __future__ import annotations

import pytest

from megatron_media_guard import MediaItem, parse_runs
from megatron_media_guard.core.alignment import align
from megatron_media_guard.core.explain import check_records, plan_records
from megatron_media_guard.core.plan import Plan
from megatron_media_guard.diagnostics import GuardRecord
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch

Q = TEST_GRAMMARS["qwen"]
RUN_REASON = "surplus: 3 features for 2 placeholders (+1)"  # sample 0, from its runs


def _report(layout, items):
    ids = build_batch(Q, layout).input_ids
    return align(parse_runs(ids, Q), items)


def _aligned(smp: int, act: str) -> GuardRecord:
    return GuardRecord(event=act, sample=smp, action=act, reason="from the callback")


@pytest.mark.parametrize(
    ("actions", "reasons", "want"),
    [
        (("keep", "keep", "keep"), (), []),
        (("drop", "keep", "raise"), (), [(0, "drop", "run"), (2, "raise", "callback")]),
        (("drop", "keep", "keep"), ((0, "suspected swap"),), [(0, "drop", "swap")]),
        (("keep", "repair", "drop"), ((2, "ignored here"),), [(2, "drop", "callback")]),
    ],
)
def test_plan_records_one_per_dropped_or_raised_sample(actions, reasons, want):
    # sample 0 is mismatched (3 features declared for a run of 2); samples 1 and 2 align
    items = [MediaItem(3, sample=0), MediaItem(4, sample=1), MediaItem(1, sample=2)]
    report = _report([[("image", 2)], [("image", 4)], [("image", 1)]], items)
    plan = Plan(actions, (), 0, reasons)
    got = plan_records(report, plan, items, 7, 1, _aligned)
    assert [(smp, act) for smp, act, _ in got] == [(smp, act) for smp, act, _ in want]
    for (_, _, rec), (_, _, kind) in zip(got, want, strict=True):
        if kind == "callback":
            assert rec.reason == "from the callback"
        elif kind == "swap":  # the plan's override reason comes first
            assert rec.reason == f"suspected swap; {RUN_REASON}"
        else:
            assert (rec.step, rec.microbatch, rec.reason) == (7, 1, RUN_REASON)


def test_check_records_name_unclaimed_items_with_the_callers_wording():
    # implicit items: two items, one run, so item 1 is tied to no run
    report = _report([[("image", 2)]], [MediaItem(2), MediaItem(5)])
    assert report.orphans == (1,)
    (rec,) = check_records(report, 3, 0, "rows {} have no run")
    assert (rec.event, rec.action, rec.reason, rec.step, rec.microbatch) == (
        "check",
        "unused",
        "rows [1] have no run",
        3,
        0,
    )
    assert check_records(_report([[("image", 2)]], [MediaItem(2)]), 3, 0, "{}") == []
