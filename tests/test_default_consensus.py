"""A MediaGuard built with no ``consensus=`` in an initialized torch.distributed job agrees
with its peers (docs/CONSENSUS.md): a fault on one of 4 gloo ranks makes every rank raise naming the
culprit, and the rank comes from torch.distributed even without ``RANK`` in the environment
(a ``spawn`` launch). ``consensus=False`` is the explicit way back to deciding alone."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from dist_harness import run_ranks
from family_checks import records

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard
from megatron_media_guard.diagnostics import get_logger
from megatron_media_guard.testing import TEST_GRAMMARS, inject

Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4)], [("image", 3)]]
CULPRIT = 2


def default_worker(rank: int, world: int, log_dir: str, mode: str) -> dict:
    os.environ.pop("RANK", None)  # as under a spawn launch: only torch.distributed knows
    if mode == "parallel_state":
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    kwargs = {"consensus": False} if mode == "off" else {}
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    get_logger().addHandler(handler)
    guard = MediaGuard(GuardConfig(log_dir=log_dir), Q, **kwargs)
    MediaGuard(GuardConfig(), Q, **kwargs).close()  # a second guard: no second announcement
    get_logger().removeHandler(handler)
    batch = inject(Q, LAYOUT, "surplus_feature" if rank == CULPRIT else "none")
    emb = torch.zeros(*batch.input_ids.shape, 8)
    out = {"rank": guard.rank.rank, "tp": guard.rank.tp, "consensus": guard.consensus is not None}
    out["announced"] = [m for m in seen if "torch.distributed is initialized" in m]
    try:
        guard.merge(emb, batch.input_ids, batch.features(8), batch.items, step=5)
        out["error"] = None
    except MediaAlignmentError as err:
        out["error"] = str(err)
        out["culprit"] = err.context.get("culprit_rank", guard.rank.rank)
    finally:
        guard.close()
        if mode == "parallel_state":
            ps.destroy_model_parallel()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["world", "parallel_state"])
def test_every_rank_raises_naming_the_culprit_without_a_consensus_argument(tmp_path, mode):
    res = run_ranks(default_worker, 4, args=(str(tmp_path), mode), timeout=120)
    assert [r["rank"] for r in res] == [0, 1, 2, 3]  # from torch.distributed, RANK unset
    assert all(r["consensus"] for r in res)
    source = "parallel_state" if mode == "parallel_state" else "the world group"
    for r in res:  # one line per process, saying which groups
        assert len(r["announced"]) == 1 and source in r["announced"][0], r["announced"]
    if mode == "parallel_state":
        assert [r["tp"] for r in res] == [0, 1, 0, 1]
    for r in res:
        assert r["error"] is not None, f"rank {r['rank']} went on while rank {CULPRIT} raised"
        assert r["culprit"] == CULPRIT
        assert f"rank {CULPRIT}" in r["error"]
    recs = records(tmp_path)
    raised = [r for r in recs if r["event"] == "raise"]
    assert [r["rank"] for r in raised] == [CULPRIT]  # the culprit's own record, not "rank ?"
    assert sorted(r["rank"] for r in recs if r["event"] == "consensus") == [0, 1, 2, 3]


@pytest.mark.timeout(150)
def test_consensus_false_decides_per_rank(tmp_path):
    res = run_ranks(default_worker, 4, args=(str(tmp_path), "off"), timeout=120)
    assert [r["consensus"] for r in res] == [False] * 4
    assert all(r["announced"] == [] for r in res)
    assert [r["error"] is not None for r in res] == [r == CULPRIT for r in range(4)]
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
