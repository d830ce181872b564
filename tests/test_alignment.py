"""Per-sample classification: every status, and errors that batch-total checks miss."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import MediaItem
from megatron_media_guard.core.alignment import Status, check_alignment
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, inject

Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4), ("image", 6)], [("image", 3)], [("video", 8)], []]


@pytest.mark.parametrize(
    ("fault", "statuses"),
    [
        ("none", {}),
        ("budget_shrink", {0: Status.SURPLUS}),
        ("surplus_feature", {0: Status.SURPLUS}),
        ("extra_pad", {0: Status.DEFICIT}),
        ("offsetting", {0: Status.SURPLUS, 1: Status.DEFICIT}),
        ("swapped_items", {0: Status.LENGTH_MISMATCH}),
        ("literal_placeholder", {0: Status.MALFORMED}),
        ("cut_by_max_len", {0: Status.TRUNCATED}),
        ("video_grid", {0: Status.SURPLUS}),
    ],
)
@pytest.mark.parametrize("explicit", [True, False])
def test_each_fault_is_classified_per_sample(fault, statuses, explicit):
    batch = inject(Q, LAYOUT, fault, explicit_samples=explicit)
    report = check_alignment(batch.input_ids, batch.items, Q)
    got = {s.sample: s.status for s in report.samples if not s.ok}
    assert got == statuses
    assert report.ok == (not statuses)


def test_offsetting_errors_pass_batch_totals_but_not_the_guard():
    batch = inject(Q, LAYOUT, "offsetting")
    report = check_alignment(batch.input_ids, batch.items, Q)
    assert report.total_placeholders == report.total_features  # what today's merges check
    assert not report.ok
    s0, s1 = report.samples[0], report.samples[1]
    assert (s0.expected, s0.got, s0.first_mismatch) == ((4, 6), (5, 6), 0)
    assert (s1.expected, s1.got, s1.first_mismatch) == ((3,), (2,), 0)


def test_swapped_items_pass_totals_and_are_caught():
    batch = inject(Q, LAYOUT, "swapped_items")
    report = check_alignment(batch.input_ids, batch.items, Q)
    assert report.total_placeholders == report.total_features
    rep = report.samples[0]
    assert rep.status is Status.LENGTH_MISMATCH
    assert (rep.expected, rep.got, rep.first_mismatch) == ((4, 6), (6, 4), 0)


@pytest.mark.parametrize(
    ("items", "status", "reason"),
    [
        (
            [MediaItem(4, 0), MediaItem(6, 0), MediaItem(2, 0)],
            Status.COUNT_MISMATCH,
            "2 placeholder runs for 3 items",
        ),
        ([MediaItem(4, 0)], Status.COUNT_MISMATCH, "2 placeholder runs for 1 items"),
        (
            [MediaItem(4, 0), MediaItem(6, 0, modality="video")],
            Status.MODALITY_MISMATCH,
            "modalities",
        ),
    ],
)
def test_count_and_modality_mismatch(items, status, reason):
    batch = build_batch(Q, [[("image", 4), ("image", 6)]])
    rep = check_alignment(batch.input_ids, items, Q).samples[0]
    assert rep.status is status
    assert reason in rep.reason


def test_implicit_assignment_resyncs_after_a_bad_sample():
    """Without sample labels the guard matches runs to items from both ends, so only the
    sample in between is blamed: an extra run in sample 1 does not shift samples 2 and 3."""
    layout = [[("image", 2)], [("image", 3), ("image", 5)], [("image", 4)], [("image", 7)]]
    batch = build_batch(Q, layout, explicit_samples=False)
    items = [it for k, it in enumerate(batch.items) if k != 2]  # sample 1 lost one item's features
    report = check_alignment(batch.input_ids, items, Q)
    assert [s.status for s in report.samples] == [
        Status.ALIGNED,
        Status.COUNT_MISMATCH,
        Status.ALIGNED,
        Status.ALIGNED,
    ]


def test_surplus_item_with_no_run_is_an_orphan_without_labels():
    batch = build_batch(Q, [[("image", 2)], []], explicit_samples=False)
    report = check_alignment(batch.input_ids, [*batch.items, MediaItem(3)], Q)
    assert report.orphans == (1,)
    assert not report.ok


def test_explicit_items_may_come_in_any_sample_order():
    batch = build_batch(Q, [[("image", 2)], [("image", 3)]])
    items = [batch.items[1], batch.items[0]]
    assert check_alignment(batch.input_ids, items, Q).ok


def test_sample_report_names_id_and_item():
    batch = inject(Q, LAYOUT, "extra_pad")
    rep = check_alignment(batch.input_ids, batch.items, Q).samples[0]
    assert rep.sample_id == "s0" and rep.items == (0, 1) and rep.row == 0
    assert rep.placeholders == 11 and rep.features == 10


def test_text_only_batch_is_aligned():
    ids = torch.full((2, 8), 1000)
    assert check_alignment(ids, [], Q).ok


def test_implicit_assignment_never_guesses_between_equal_keys():
    """Sample 0 lost its last run (cut away); the next item has the same length as the
    lost one. Pairing in order would hand sample 0's item to sample 1's run: silent
    corruption. The guard leaves the ambiguous items unclaimed and blames sample 1 too."""
    layout = [[("image", 7), ("image", 3), ("image", 1)], [("image", 1)]]
    full = build_batch(Q, layout, explicit_samples=False)
    cut = build_batch(Q, [[("image", 7), ("image", 3)], [("image", 1)]], explicit_samples=False)
    report = check_alignment(cut.input_ids, full.items, Q)
    assert report.samples[0].ok and report.samples[0].items == (0, 1)
    assert report.samples[1].status is Status.COUNT_MISMATCH
    assert report.orphans == (2, 3)


def test_implicit_assignment_with_an_extra_run_blames_every_sample_it_could_be_in():
    # runs [2, 3 | 3, 5], items [2, 3, 5]: the extra 3 is in sample 0 or sample 1
    batch = build_batch(
        Q, [[("image", 2), ("image", 3)], [("image", 3), ("image", 5)]], explicit_samples=False
    )
    items = [MediaItem(2), MediaItem(3), MediaItem(5)]
    statuses = [s.status for s in check_alignment(batch.input_ids, items, Q).samples]
    assert statuses == [Status.COUNT_MISMATCH, Status.COUNT_MISMATCH]


T = 1000


@pytest.mark.parametrize(
    ("ids", "lengths", "statuses", "orphans"),
    [
        # one item for three samples' runs: which sample owns it is unknown
        (
            [[T, 3, 5, 4, T, T], [T, 3, 5, 4, T, T], [T, 3, 5, 5, 4, T]],
            [1],
            ["count_mismatch"] * 3,
            (0,),
        ),
        # two stray items around the real ones: sample 0's 3 could be either 3-item
        (
            [[T, 3, 5, 5, 5, 4, T], [T, 3, 5, 5, 4, T, T]],
            [3, 3, 2, 4],
            ["count_mismatch", "aligned"],
            (0, 1, 3),
        ),
        # an item without features owns no run: the two 1-items compete for one run
        ([[T, 3, 4, T, 3, 5, 4, T]], [0, 1, 1], ["count_mismatch"], (1, 2)),
    ],
)
def test_implicit_assignment_with_several_extras_never_guesses(ids, lengths, statuses, orphans):
    """Found by a red-team search: with two or more extra items (or runs) the one-block
    model paired a run with a guessed item. Only pairs every matching agrees on are kept."""
    report = check_alignment(torch.tensor(ids), [MediaItem(n) for n in lengths], Q)
    assert [str(s.status) for s in report.samples] == statuses
    assert report.orphans == orphans


def test_featureless_item_with_a_literal_placeholder_in_another_sample():
    plain = TEST_GRAMMARS["plain"]  # image 13, video 14, no markers
    ids = torch.tensor([[13, 0, 0, 0, 0, 0, 0, 0], [T, 13, T, T, 14, 14, T, T]])
    items = [MediaItem(1), MediaItem(0), MediaItem(2, modality="video")]
    report = check_alignment(ids, items, plain)
    # sample 0's literal placeholder must not receive sample 1's image
    assert [str(s.status) for s in report.samples] == ["count_mismatch", "count_mismatch"]
