"""What the fault path says: the records it writes for a plan (one per dropped or raised
sample, in sample order, and ``check`` records for what no sample's decision covers), one line
per record everywhere; errors that say their cause (NaN/Inf raises and records name
``nonfinite``, the item and the sample_id); labels that cannot hold ``ignore_index`` refused;
nothing in building the message can replace the alignment error."""

from __future__ import annotations

import html

import pytest
import torch
from family_checks import records

from megatron_media_guard import (
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
    parse_runs,
)
from megatron_media_guard.core import explain
from megatron_media_guard.core.alignment import align
from megatron_media_guard.core.explain import check_records, plan_records
from megatron_media_guard.core.plan import Plan
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.diagnostics.report import summarize
from megatron_media_guard.diagnostics.report_format import format_summary
from megatron_media_guard.diagnostics.report_html import render_html
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, inject

Q = TEST_GRAMMARS["qwen"]
RUN_REASON = "surplus: 3 features for 2 placeholders (+1)"  # sample 0, from its runs


def _report(layout, items):
    ids = build_batch(Q, layout).input_ids
    return align(parse_runs(ids, Q), items)


@pytest.mark.parametrize(
    ("actions", "reasons", "extra", "want"),
    [
        (("keep", "keep", "keep"), (), {}, []),
        (("drop", "keep", "raise"), (), {}, [(0, "drop", RUN_REASON), (2, "raise", "nonfinite")]),
        (("drop", "keep", "keep"), ((0, "suspected swap"),), {}, [(0, "drop", "swap; run")]),
        (("keep", "repair", "drop"), ((2, "call: bad"),), {}, [(2, "drop", "call: bad")]),
        (
            ("drop", "keep", "drop"),
            (),
            {"nonfinite": {2: [2]}, "failed": {0: "repair failed, x"}},
            [(0, "drop", f"repair failed, x; {RUN_REASON}"), (2, "drop", "item 2")],
        ),
    ],
)
def test_plan_records_one_per_dropped_or_raised_sample(actions, reasons, extra, want):
    # sample 0 is mismatched (3 features declared for a run of 2); samples 1 and 2 align
    items = [MediaItem(3, sample=0), MediaItem(4, sample=1), MediaItem(1, sample=2)]
    report = _report([[("image", 2)], [("image", 4)], [("image", 1)]], items)
    plan = Plan(actions, (), 0, reasons)
    kw = {"nonfinite": {}, "gen": None, "failed": {}, **extra}
    got = plan_records(report, plan, items, 7, 1, **kw)
    assert [(r.sample, r.event, r.action) for r in got] == [(s, a, a) for s, a, _ in want]
    for rec, (_, _, reason) in zip(got, want, strict=True):
        assert (rec.step, rec.microbatch) == (7, 1)
        if reason == "nonfinite":  # aligned, no reason: its features are why
            assert rec.extra["status"] == "nonfinite"
        elif reason == "item 2":
            assert (rec.item, rec.reason) == (2, "nonfinite: NaN/Inf in the features of item 2")
        elif reason == "swap; run":  # the plan's override reason comes first
            assert rec.reason == f"suspected swap; {RUN_REASON}"
        else:
            assert rec.reason == reason
    if actions[2] == "drop" and reasons:  # aligned, given the policy for the call's sake
        assert got[0].extra == {"status": "call"} and got[0].item is None


def test_check_records_name_unclaimed_items():
    # implicit items: two items, one run, so item 1 is tied to no run
    report = _report([[("image", 2)]], [MediaItem(2), MediaItem(5)])
    assert report.orphans == (1,)
    (rec,) = check_records(report, 3, 0)
    assert (rec.event, rec.action, rec.step, rec.microbatch) == ("check", "unused", 3, 0)
    assert rec.reason == "items [1] could not be tied to a placeholder run"
    assert check_records(_report([[("image", 2)]], [MediaItem(2)]), 3, 0) == []


# -- one line per record: the console, the exception, the report and the page say the same ----
FAULT_CASES = ["surplus_feature", "extra_pad", "swapped_items", "offsetting", "cut_by_max_len"]
LAYOUT = [[("image", 4), ("image", 6)], [("image", 3)], [("video", 8)], []]


@pytest.mark.parametrize("fault", FAULT_CASES)
def test_one_record_line_everywhere_each_fact_once(tmp_path, capsys, fault):
    batch = inject(Q, LAYOUT, fault)
    guard = MediaGuard(GuardConfig(log_dir=str(tmp_path)), Q, rank=RankInfo(rank=2))
    emb = torch.zeros(*batch.input_ids.shape, 8)
    with pytest.raises(MediaAlignmentError) as info:
        guard.merge(emb, batch.input_ids, batch.features(8), batch.items, step=4, microbatch=0)
    guard.close()
    console = [
        x for x in capsys.readouterr().err.splitlines() if x.startswith("[media-guard] rank 2")
    ]
    raised = [x for x in console if x.endswith("-> raise")]
    assert raised, console
    head = "[media-guard] rank 2, step 4, microbatch 0: "
    msg = str(info.value)
    assert msg.splitlines()[0].startswith("Media alignment failed (rank 2, step 4, microbatch 0)")
    for line in raised:
        assert line.startswith(head)
        # the exception carries the same line, less the where its first line already says
        assert "  " + line.removeprefix(head) in msg.splitlines(), (line, msg)
        for internal in ("status=", "findings=[]", "extra "):
            assert internal not in line, line
        # each fact once: the sample, the status word, the two totals
        body = line.removeprefix(head)
        assert body.count("sample ") == 1, line
        for word in ("surplus", "deficit", "length_mismatch", "count_mismatch", "truncated"):
            assert body.count(word) <= 1, (word, line)
        totals = [t for t in body.split() if t.isdigit()]
        assert len(totals) == len(set(totals)) or "x" in body or "[" in body, line
    summary = summarize(tmp_path, jobs=1)
    first = next(x for x in format_summary(summary).splitlines() if x.startswith("first fatal"))
    assert first == "first fatal: " + raised[0].removeprefix("[media-guard] ")
    page = render_html(summary)
    assert (
        html.escape(raised[0].removeprefix("[media-guard] "), quote=False) in html.unescape(page)
        or html.escape(raised[0].removeprefix("[media-guard] ")) in page
    )


# ---- errors that say their cause ---------------------------------------------------------
TWO_SAMPLES = [[("image", 4)], [("image", 3), ("image", 2)]]


@pytest.mark.parametrize("item, sample, sid", [(0, 0, "id-0"), (2, 1, "id-1")])
@pytest.mark.parametrize("nonfinite", ["raise", "drop"])
def test_nonfinite_names_cause_item_and_sample_id(tmp_path, item, sample, sid, nonfinite):
    batch = inject(Q, TWO_SAMPLES, "none")
    items = [
        MediaItem(it.num_features, sample=it.sample, sample_id=f"id-{i}")
        for i, it in enumerate(batch.items)
    ]
    feats = batch.features(8)
    feats[sum(it.num_features for it in items[:item]) + 1, 3] = float("nan")
    cfg = GuardConfig(log_dir=str(tmp_path), nonfinite=nonfinite)
    guard = MediaGuard(cfg, Q, rank=RankInfo(rank=0))
    emb = torch.zeros(*batch.input_ids.shape, 8)
    if nonfinite == "drop":
        assert guard.merge(emb, batch.input_ids, feats, items).report.dropped == (sample,)
    else:
        with pytest.raises(MediaAlignmentError) as info:
            guard.merge(emb, batch.input_ids, feats, items, step=2)
        msg = str(info.value)
        assert f"nonfinite: NaN/Inf in the features of item {item}" in msg
        assert f"sample {sample} (sample_id {sid!r})" in msg  # the sample's id: its first item's
        assert "aligned — ." not in msg
    (rec,) = records(tmp_path)
    assert rec["event"] == nonfinite and rec["reason"].startswith("nonfinite")
    assert (rec["sample"], rec["item"]) == (sample, item)
    assert rec["sample_id"] == sid and rec["extra"]["items"] == [item]


CANNOT_HOLD = "cannot hold ignore_index -100"


@pytest.mark.parametrize(
    "labels, refused",
    [
        (torch.int64, None),
        (torch.int32, None),
        (torch.int16, None),
        (torch.int8, None),  # -100 fits
        (torch.uint8, CANNOT_HOLD),  # -100 would wrap to 156
        (torch.bool, CANNOT_HOLD),
        # the library's error on both stages (not an AttributeError from deep inside)
        (torch.float32, "labels must be integer"),
        (torch.ones(2, 3, dtype=torch.int64), r"labels must be \[b, s\]"),
        ([[1, 2, 3]], r"labels must be \[b, s\]"),
    ],
)
@pytest.mark.parametrize("path", ["merge", "last_stage"])
def test_labels_the_guard_cannot_mask_are_refused_by_both_stages(labels, refused, path):
    batch = inject(Q, TWO_SAMPLES, "surplus_feature")
    guard = MediaGuard(GuardConfig(policy="drop"), Q, rank=RankInfo(rank=0))
    if isinstance(labels, torch.dtype):
        labels = torch.ones(batch.input_ids.shape, dtype=labels)
    emb = torch.zeros(*batch.input_ids.shape, 8)

    def call():
        if path == "merge":
            return guard.merge(emb, batch.input_ids, batch.features(8), batch.items, labels=labels)
        return guard.last_stage(batch.input_ids, batch.items, labels=labels)

    if refused is None:
        res = call()
        assert (res.labels == -100).any() and res.labels.dtype == labels.dtype
    else:
        with pytest.raises(MediaInputError, match=refused):
            call()


def test_message_building_cannot_hide_the_alignment_error(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("a field that cannot be printed")

    monkeypatch.setattr(explain, "summary_line", broken)
    batch = inject(Q, TWO_SAMPLES, "surplus_feature")
    guard = MediaGuard(GuardConfig(log_dir=str(tmp_path)), Q, rank=RankInfo(rank=4))
    emb = torch.zeros(*batch.input_ids.shape, 8)
    with pytest.raises(MediaAlignmentError) as info:
        guard.merge(emb, batch.input_ids, batch.features(8), batch.items, step=9)
    msg = str(info.value)
    assert "Media alignment failed (rank 4, step 9)" in msg and "RuntimeError" in msg
    assert "per-rank log:" in msg
