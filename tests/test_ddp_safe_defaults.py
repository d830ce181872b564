"""The guard's defaults in a real DDP training loop: 2 gloo ranks, the tiny transformers
Qwen2.5-VL under ``install_qwen_vl``, AdamW; the guard built before ``init_process_group`` (no
``consensus=``, no ``rank=``, ``RANK`` unset). A rank whose batch must raise (a mismatch at step
1 on rank 1, a bad input at step 3 on rank 0) makes every rank raise at that step, naming the
culprit and what failed, before any vision tower runs, instead of hanging in DDP's all-reduce;
each rank writes its own log; between the faults the loop trains on, the replicas equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_harness import run_ranks

pytest.importorskip("transformers.models.qwen2_5_vl")
pytest.importorskip("PIL")

STEPS = 5
FAULTS = {1: (1, "mismatch"), 3: (0, "bad_input")}  # step -> (rank, what)


def ddp_worker(rank: int, world: int, init, log_dir: str) -> dict:
    import os

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaGuardError
    from megatron_media_guard.adapters import install_qwen_vl
    from megatron_media_guard.testing.qwen_vl import Sample, seed_failure, smooth_image, tiny_model

    assert "RANK" not in os.environ
    samples = [Sample((("image", smooth_image(150, 200, 1)),)), Sample(())]
    engine, mixed = seed_failure("qwen2_5_vl", samples, 12, 30)
    bad = dict(engine, pixel_values=engine["pixel_values"][:-1])  # one patch row short
    model = tiny_model("qwen2_5_vl", seed=0)
    towers = []  # the vision tower's calls: a raise comes before the tower runs
    model.model.visual.register_forward_hook(lambda m, a, o: towers.append(1))
    step = [0]
    guard = MediaGuard(GuardConfig(policy="raise", log_dir=log_dir), grammar=Grammar.qwen2_vl())
    install_qwen_vl(model, guard, step_provider=lambda: step[0])
    init()  # the process group comes after the guard
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    out: dict = {"raised": {}, "trained": []}
    for s in range(STEPS):
        step[0] = s
        culprit, what = FAULTS.get(s, (None, None))
        batch = engine
        if culprit == rank:
            batch = mixed if what == "mismatch" else bad
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        opt.zero_grad()
        ran = len(towers)
        try:
            loss = ddp(**batch, labels=labels).loss
        except MediaGuardError as err:  # rank 0's bad input is a MediaInputError there
            out["raised"][s] = {
                "culprit": err.context.get("culprit_rank", guard.rank.rank),
                "msg": str(err),
                "tower_ran": len(towers) > ran,
            }
            continue
        loss.backward()
        opt.step()
        guard.on_step_end(s)
        out["trained"].append(s)
    out["rank"] = guard.rank.rank
    out["log"] = None if guard.log.path is None else guard.log.path.name
    out["checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    guard.close()
    return out


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_guard_built_before_init_process_group_stops_every_rank_together(tmp_path):
    res = run_ranks(
        ddp_worker, 2, args=(str(tmp_path),), timeout=200, pg_timeout=45, late_init=True
    )
    assert [r["rank"] for r in res] == [0, 1]  # from torch.distributed, RANK unset
    for r in res:
        assert sorted(r["raised"]) == sorted(FAULTS), (r["rank"], r["raised"])
        assert r["trained"] == [s for s in range(STEPS) if s not in FAULTS]
        for s, (culprit, _) in FAULTS.items():
            assert r["raised"][s]["culprit"] == culprit, r["raised"][s]
            assert not r["raised"][s]["tower_ran"], (r["rank"], s)
    peer_mismatch = res[0]["raised"][1]["msg"]
    assert "failed on rank 1 (step 1, sample 0)" in peer_mismatch, peer_mismatch
    peer_bad = res[1]["raised"][3]["msg"]
    assert "sample None" not in peer_bad, peer_bad
    assert "failed on rank 0 (step 3): MediaInputError: " in peer_bad, peer_bad
    assert "pixel rows disagree with the grids" in peer_bad.splitlines()[0], peer_bad
    assert res[0]["checksum"] == res[1]["checksum"]  # DDP kept the replicas equal
    assert [r["log"] for r in res] == ["media_guard.rank00000.jsonl", "media_guard.rank00001.jsonl"]
    for r in (0, 1):
        path = Path(tmp_path) / f"media_guard.rank{r:05d}.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        assert recs and {rec["rank"] for rec in recs} == {r}, recs
        steps = {rec["step"] for rec in recs if rec["event"] == "consensus"}
        assert steps == set(FAULTS), recs
