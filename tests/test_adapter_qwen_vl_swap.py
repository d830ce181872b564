"""Swaps are never repaired: items exchanged between samples take the fallback with the reason
"suspected swap", in MediaGuard.merge's repair and in the Qwen-VL pre-hook alike."""

from __future__ import annotations

import pytest
import torch
from family_checks import records
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import Grammar, GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.core.alignment import check_alignment
from megatron_media_guard.core.plan import REPAIRABLE, SWAP_REASON, suspected_swaps
from megatron_media_guard.geometry import PatchMergeGeometry

G = Grammar.qwen2_vl()
IMG, START, END = G.placeholders["image"], G.start_id, G.end_id


def ids_for(runs: list[list[int]]) -> torch.Tensor:
    rows = [[7] + [t for n in rs for t in (START, *[IMG] * n, END, 8)] for rs in runs]
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def swaps(runs: list[list[int]], feats: list[list[int]]) -> set[int]:
    items = [MediaItem(n, sample=s) for s, fs in enumerate(feats) for n in fs]
    return set(suspected_swaps(check_alignment(ids_for(runs), items, G), REPAIRABLE))


@pytest.mark.parametrize(
    ("runs", "feats", "flagged"),
    [
        # one item per sample, exchanged: test_any_cross_sample_permutation_is_flagged
        ([[6, 4], [8]], [[8, 4], [6]], {0, 1}),  # next to an aligned item
        ([[6], [8]], [[12], [16]], set()),  # budget shrink: every item larger, no match
        ([[6], [8]], [[7], [7]], set()),  # +1 / -1 offsetting
        ([[6], [6]], [[9], [9]], set()),  # the seed failure: equal runs, equal items
        ([[6]], [[8]], set()),  # one sample alone
        ([[5, 7], [4]], [[7, 5], [4]], set()),  # swapped inside a sample: not repairable
    ],
)
def test_suspected_swaps(runs, feats, flagged):
    assert swaps(runs, feats) == flagged


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_cross_sample_permutation_is_flagged(data):
    n = data.draw(st.integers(2, 5))
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n, unique=True))
    perm = data.draw(st.permutations(range(n)))
    moved = {i for i in range(n) if perm[i] != i}
    feats = [[lengths[perm[i]]] for i in range(n)]
    got = swaps([[x] for x in lengths], feats)
    assert got == (moved if len(moved) > 1 else set())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_shrink_of_every_item_is_not_a_swap(data):
    n = data.draw(st.integers(1, 5))
    runs = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    feats = [[r + data.draw(st.integers(41, 80))] for r in runs]  # items above every run
    assert swaps([[r] for r in runs], feats) == set()


@pytest.mark.parametrize("fallback", ["drop", "raise"])
def test_merge_repair_falls_back_on_a_swap(fallback, tmp_path):
    ids = ids_for([[6], [8]])
    items = [MediaItem(8, sample=0), MediaItem(6, sample=1)]  # exchanged media
    feats = torch.randn(14, 4)

    def encoder(*a, **k):
        raise AssertionError("a suspected swap must not be re-encoded")

    guard = MediaGuard(
        GuardConfig(policy="repair", fallback=fallback, log_dir=str(tmp_path)),
        G,
        geometry=PatchMergeGeometry(),
        encoder=encoder,
    )
    emb = torch.zeros(*ids.shape, 4)
    if fallback == "raise":
        with pytest.raises(MediaAlignmentError, match=SWAP_REASON):
            guard.merge(emb, ids, feats, items)
        return
    res = guard.merge(emb, ids, feats, items)
    assert res.report.actions == ("drop", "drop") and res.report.repaired == ()
    swap_dropped(tmp_path)


def swap_dropped(log_dir) -> None:
    """The records: samples 0 and 1 dropped as a suspected swap, nothing repaired."""
    recs = records(log_dir)
    assert not [r for r in recs if r["event"] == "repair"]
    drops = [r for r in recs if r["event"] == "drop"]
    assert [r["sample"] for r in drops] == [0, 1]
    assert all(r["reason"].startswith(SWAP_REASON) for r in drops)


def test_qwen_vl_swap_under_repair(tmp_path):
    pytest.importorskip("transformers.models.qwen2_5_vl")
    pytest.importorskip("PIL")
    from megatron_media_guard.adapters import install_qwen_vl
    from megatron_media_guard.testing.qwen_vl import Sample, build_batch, smooth_image, tiny_model

    a, b = smooth_image(56, 84, 1), smooth_image(84, 112, 2)
    batch = build_batch([Sample((("image", a),)), Sample((("image", b),))], "qwen2_5_vl", 14, 10**6)
    pv, grid = batch["pixel_values"], batch["image_grid_thw"]
    n0 = int(grid[0].prod())
    swapped = dict(batch, mm_token_type_ids=None, image_grid_thw=grid.flip(0))
    swapped["pixel_values"] = torch.cat([pv[n0:], pv[:n0]])
    model = tiny_model("qwen2_5_vl")
    with torch.no_grad():
        model(**swapped)  # plain transformers: trains silently on the other sample's image
        guard = MediaGuard(
            GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path)),
            G,
            geometry=PatchMergeGeometry(),
        )
        with install_qwen_vl(model, guard) as h:
            model(**swapped)
    assert h.last_result.report.actions == ("drop", "drop")
    swap_dropped(tmp_path)
