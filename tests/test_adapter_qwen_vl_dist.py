"""install_qwen_vl on 2 gloo ranks (the real tiny transformers Qwen2.5-VL on each): a mismatch on
one rank under ``raise`` makes every rank raise naming it, in the pre-hook's consensus round,
before any vision tower runs; under ``drop`` the ranks agree and go on."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks

pytest.importorskip("transformers.models.qwen2_5_vl")
pytest.importorskip("PIL")


def qwen_worker(rank: int, world: int, policy: str) -> dict:
    import torch

    from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaGuardError
    from megatron_media_guard.adapters import install_qwen_vl
    from megatron_media_guard.diagnostics import RankInfo
    from megatron_media_guard.ranks.consensus import StageConsensus
    from megatron_media_guard.testing.qwen_vl import Sample, seed_failure, smooth_image, tiny_model

    samples = [Sample((("image", smooth_image(150, 200, 1)),)), Sample(())]
    engine, mixed = seed_failure("qwen2_5_vl", samples, 12, 30)
    model = tiny_model("qwen2_5_vl")
    calls = []
    model.model.visual.register_forward_hook(lambda m, a, o: calls.append(1))
    guard = MediaGuard(
        GuardConfig(policy=policy),
        grammar=Grammar.qwen2_vl(),
        rank=RankInfo(rank=rank),
        consensus=StageConsensus(),
    )
    install_qwen_vl(model, guard, step_provider=lambda: 5)
    out = {"raised": None, "culprit": None, "msg": ""}
    try:
        with torch.no_grad():
            model(**(mixed if rank == 1 else engine))
    except MediaGuardError as err:
        out.update(raised=True, culprit=err.context.get("culprit_rank"), msg=str(err))
    out["tower_calls"] = len(calls)
    out["stage_dropped"] = guard.counters["dropped"]
    return out


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_one_rank_mismatched_raise_stops_every_rank():
    res = run_ranks(qwen_worker, 2, args=("raise",), timeout=150, pg_timeout=160)
    assert all(r["raised"] for r in res), res
    assert res[0]["culprit"] == 1 and "failed on rank 1 (step 5, sample 0)" in res[0]["msg"]
    assert (
        "rank 1, step 5" in res[1]["msg"]
        and "image item 0 (112x168 (HxW), grid 1x8x12)" in res[1]["msg"]
    )
    assert [r["tower_calls"] for r in res] == [0, 0]  # raised before the vision tower


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_one_rank_mismatched_drop_goes_on():
    res = run_ranks(qwen_worker, 2, args=("drop",), timeout=150, pg_timeout=160)
    assert [r["raised"] for r in res] == [None, None]
    assert [r["stage_dropped"] for r in res] == [0, 1]
    # rank 1's only item was dropped: the tower still ran once (anchored), as on rank 0
    assert [r["tower_calls"] for r in res] == [1, 1]
