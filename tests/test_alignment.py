"""Per-sample classification: every status, and errors that batch-total checks miss."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import MediaItem
from megatron_media_guard.core.alignment import Status, check_alignment
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, inject

Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4), ("image", 6)], [("image", 3)], [("video", 8)], []]


# counts: sample -> (run lengths, item lengths), for errors that pass the batch totals
@pytest.mark.parametrize(
    ("fault", "statuses", "counts"),
    [
        ("none", {}, None),
        ("budget_shrink", {0: Status.SURPLUS}, None),
        ("surplus_feature", {0: Status.SURPLUS}, None),
        ("extra_pad", {0: Status.DEFICIT}, None),
        (
            "offsetting",
            {0: Status.SURPLUS, 1: Status.DEFICIT},
            {0: ((4, 6), (5, 6)), 1: ((3,), (2,))},
        ),
        ("swapped_items", {0: Status.LENGTH_MISMATCH}, {0: ((4, 6), (6, 4))}),
        ("literal_placeholder", {0: Status.MALFORMED}, None),
        ("cut_by_max_len", {0: Status.TRUNCATED}, None),
        ("video_grid", {0: Status.SURPLUS}, None),
    ],
)
@pytest.mark.parametrize("explicit", [True, False])
def test_each_fault_is_classified_per_sample(fault, statuses, counts, explicit):
    batch = inject(Q, LAYOUT, fault, explicit_samples=explicit)
    report = check_alignment(batch.input_ids, batch.items, Q)
    assert {s.sample: s.status for s in report.mismatched} == statuses
    assert report.ok == (not statuses)
    if counts is not None:  # caught per sample, though the totals agree (what merges check)
        assert report.total_placeholders == report.total_features
        assert {s.sample: (s.expected, s.got) for s in report.mismatched} == counts
        assert [s.first_mismatch for s in report.mismatched] == [0] * len(counts)


IMAGES = [MediaItem(4, 0), MediaItem(6, 0)]  # the items of one sample's two images


@pytest.mark.parametrize(
    ("items", "status", "reason"),
    [
        ([*IMAGES, MediaItem(2, 0)], Status.COUNT_MISMATCH, "2 placeholder runs for 3 items"),
        (IMAGES[:1], Status.COUNT_MISMATCH, "2 placeholder runs for 1 items"),
        ([IMAGES[0], MediaItem(6, 0, modality="video")], Status.MODALITY_MISMATCH, "modalities"),
    ],
)
def test_count_and_modality_mismatch(items, status, reason):
    batch = build_batch(Q, [[("image", 4), ("image", 6)]])
    rep = check_alignment(batch.input_ids, items, Q).samples[0]
    assert rep.status is status
    assert reason in rep.reason


def test_explicit_items_may_come_in_any_sample_order():
    batch = build_batch(Q, [[("image", 2)], [("image", 3)]])
    items = [batch.items[1], batch.items[0]]
    assert check_alignment(batch.input_ids, items, Q).ok


def test_sample_report_names_id_and_item():
    batch = inject(Q, LAYOUT, "extra_pad")
    rep = check_alignment(batch.input_ids, batch.items, Q).samples[0]
    assert rep.sample_id == "s0" and rep.items == (0, 1) and rep.row == 0
    assert rep.placeholders == 11 and rep.features == 10


@pytest.mark.parametrize(
    ("layout", "lengths", "statuses", "orphans"),
    [
        # sample 1 lost an item: runs are matched from both ends, so only it is blamed
        (
            [[2], [3, 5], [4], [7]],
            [2, 3, 4, 7],
            ["aligned", "count_mismatch", "aligned", "aligned"],
            (),
        ),
        ([[], []], [], ["aligned", "aligned"], ()),  # text only
        ([[2], []], [2, 3], ["aligned", "aligned"], (1,)),  # a surplus item owns no run
        # sample 0 lost its last run, the next item as long as the lost one: pairing in order
        # would feed sample 0's item to sample 1; the ambiguous items stay unclaimed
        ([[7, 3], [1]], [7, 3, 1, 1], ["aligned", "count_mismatch"], (2, 3)),
        # an extra run of 3 in sample 0 or 1: both are blamed
        ([[2, 3], [3, 5]], [2, 3, 5], ["count_mismatch", "count_mismatch"], (1,)),
        # found by a red-team search: with two or more extra items (or runs) only the pairs
        # every matching agrees on are kept. One item for three samples' runs:
        ([[1], [1], [2]], [1], ["count_mismatch"] * 3, (0,)),
        ([[3], [2]], [3, 3, 2, 4], ["count_mismatch", "aligned"], (0, 1, 3)),  # two strays
        ([[1]], [0, 1, 1], ["count_mismatch"], (1, 2)),  # featureless items own no run
    ],
)
def test_implicit_assignment_never_guesses(layout, lengths, statuses, orphans):
    batch = build_batch(Q, [[("image", n) for n in smp] for smp in layout], explicit_samples=False)
    report = check_alignment(batch.input_ids, [MediaItem(n) for n in lengths], Q)
    assert [str(s.status) for s in report.samples] == statuses
    assert report.orphans == orphans and report.ok == (not orphans and set(statuses) == {"aligned"})


def test_featureless_item_with_a_literal_placeholder_in_another_sample():
    plain = TEST_GRAMMARS["plain"]  # image 13, video 14, no markers
    t = 1000  # a text token
    ids = torch.tensor([[13, 0, 0, 0, 0, 0, 0, 0], [t, 13, t, t, 14, 14, t, t]])
    items = [MediaItem(1), MediaItem(0), MediaItem(2, modality="video")]
    report = check_alignment(ids, items, plain)
    # sample 0's literal placeholder must not receive sample 1's image
    assert [str(s.status) for s in report.samples] == ["count_mismatch", "count_mismatch"]
