"""LLaVA's faults on core's item-fault path: the records and message are core's, and a
sample with an image token too many or too few leaves a replay bundle that replays to the
same sample (a collapsed grammar's replay checks the runs per sample)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.models.multimodal.llava_model")

from family_checks import records
from llava_standins import LLaVAStandIn
from test_adapter_llava import CROSS, LAYOUT, TOK, call, guard_for, make_batch

from megatron_media_guard import Grammar, MediaAlignmentError, MediaItem
from megatron_media_guard.adapters import install_llava
from megatron_media_guard.core.alignment import Status, check_alignment
from megatron_media_guard.replay.bundle import load_bundle
from megatron_media_guard.replay.rerun import replay


@pytest.mark.parametrize(
    "layout, items, want",
    [
        # tokens per sample vs items per sample: only the count is read (a run is its item)
        ([[1], [2, 5]], [(6, 0), (3, 1), (3, 1)], {}),
        (
            [[1], [2, 5]],
            [(6, 0), (3, 0), (3, 1)],
            {0: Status.COUNT_MISMATCH, 1: Status.COUNT_MISMATCH},
        ),
        ([[1, 3], []], [(6, 0), (3, 0), (3, 1)], {1: Status.COUNT_MISMATCH}),
        ([[1], [2]], [(6, None), (9, None)], {}),  # implicit: as many runs as items, in order
    ],
)
def test_collapsed_alignment_checks_runs_per_sample(layout, items, want):
    ids = torch.ones(len(layout), 8, dtype=torch.long)
    for r, cols in enumerate(layout):
        for c in cols:
            ids[r, c] = TOK
    its = [MediaItem(n, sample=s) for n, s in items]
    report = check_alignment(ids, its, Grammar.llava(TOK))
    assert {r.sample: r.status for r in report.mismatched} == want


def test_count_fault_bundle_replays_to_the_same_sample(tmp_path):
    x = make_batch(LAYOUT)
    x["ids"][0, 7] = TOK  # a literal <image> typed in sample 0's text
    model = LLaVAStandIn()
    items = [MediaItem(6, sample=0), MediaItem(3, sample=1), MediaItem(3, sample=1)]
    items.append(MediaItem(6, sample=2))
    handle = install_llava(model, guard_for("raise", dump_dir=str(tmp_path / "b")))
    handle.set_items(items)
    with pytest.raises(MediaAlignmentError) as e:
        call(model, x)
    assert "replay bundle:" in str(e.value)
    path = str(e.value).split("replay bundle: ")[1].splitlines()[0].strip()
    result = replay(load_bundle(path))
    assert result.mismatched == (0,) == result.saved_mismatched
    assert "sample 0" in result.message and "2 runs for 1 item" in result.message


def test_max_length_fault_raises_the_record_the_peers_fetch_and_leaves_no_bundle(tmp_path):
    x = make_batch(CROSS)  # sample 2's image crosses the max length: no token is wrong
    model = LLaVAStandIn(maxlen=8)
    guard = guard_for("raise", log_dir=str(tmp_path), dump_dir=str(tmp_path / "b"))
    seen = []
    settle = guard.settle
    guard.settle = lambda local: seen.append(local) or settle(local)  # what consensus gets
    handle = install_llava(model, guard)
    handle.set_step(4)
    with pytest.raises(MediaAlignmentError) as e:
        call(model, x)
    # a replay cannot re-run a max-length fault: no bundle
    assert "replay bundle" not in str(e.value)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    raised = [r for r in records(tmp_path) if r["event"] == "raise"]
    assert raised[0]["sample"] == 2 and raised[0]["extra"] == {
        "adapter": "llava",
        "check": "max_length",
    }
    assert seen[0].record["sample"] == 2 and seen[0].record["event"] == "raise"
