"""``python -m benchmarks --quick`` used to crash in ``bench_fault_path.inputs`` (its quick
batch had 2 samples, the "drop, all 4 bad" case names samples 0..3). Every case's inputs are
built at both sizes' batch shape and the quick timing round runs (the full ``--quick`` run
takes minutes on a shared CPU: not here)."""

from __future__ import annotations

import math

import pytest

from benchmarks import bench_fault_path as bfp


@pytest.mark.parametrize("case", list(bfp.CASES))
def test_every_case_fits_the_batch_and_its_quick_inputs_hold_it(case):
    bad = bfp.CASES[case][1]
    assert all(s < bfp.sizes(quick)[0] for quick in (True, False) for s in bad), case
    _emb, ids, feats, items = bfp.inputs(bad, *bfp.sizes(True))
    placeholders = int((ids == bfp.G.placeholders["image"]).sum())
    assert feats.shape[0] == sum(it.num_features for it in items) == placeholders


def test_quick_timing_round_runs():
    ratios = bfp.time_ratios(True, 1)
    assert set(ratios) == set(bfp.CASES)
    assert all(len(v) == 1 and math.isfinite(v[0]) and v[0] > 0 for v in ratios.values())


def test_a_case_naming_a_sample_outside_the_batch_is_refused():
    with pytest.raises(ValueError, match="bad samples"):
        bfp.inputs((4,), *bfp.sizes(True))


def test_the_qwen_vl_repair_rows_repair_both_items():
    """``bench_qwen_vl``'s repair rows assert that the guard repairs the image and the video of
    their seed failure (they broke once unnoticed: the guard lacked the originals' sizes)."""
    pytest.importorskip("transformers.models.qwen2_5_vl")
    from benchmarks import bench_qwen_vl as bq

    rows = bq._repair_rows(bq.tiny_model(bq.FAMILY), 1)
    calls = {r["metric"]: r["value"] for r in rows if "tower calls" in r["metric"]}
    assert len(set(calls.values())) == 1, calls  # the guarded repair: the plain tower calls
