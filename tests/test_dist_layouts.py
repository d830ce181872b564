"""Consensus on 4 gloo ranks: TP2 x DP2, DP2 x CP2 and PP2 x DP2 (megatron-core parallel_state).

One spawn per layout runs every scenario in sequence (a scenario that raises leaves
the ranks in lockstep, so the next one starts clean). Asserted per stage: every rank
takes the same action, every error names the culprit rank, nothing hangs (the
harness kills the ranks and fails after its bound), a disagreement injected on one
rank is caught by the digest, and the drop budget trips on every rank at one step.
The PP layout's last stage computes its loss mask from ids + item metadata
(``MediaGuard.last_stage``) and must drop exactly what the first stage dropped.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from dist_harness import run_ranks
from family_checks import records
from test_plan_determinism import Geo, encoder

H = 8
LAYOUTS = {"tp2_dp2": (2, 1, 1), "dp2_cp2": (1, 1, 2), "pp2_dp2": (1, 2, 1)}
MEDIA = [[("image", 4), ("image", 6)], [("image", 3)], [("image", 8)], [("image", 5)]]


def _oom(pixels: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("CUDA out of memory (injected on this rank)")


# scenario: (policy, steps, fault(rank, dp, step) -> fault name or None, extra)
def _shrink(where):
    """The budget_shrink fault on the ranks where ``where(rank, dp)`` holds."""
    return lambda rank, dp, step: "budget_shrink" if where(rank, dp) else None


def _budget(rank, dp, step):
    if step == 0:
        return "budget_shrink" if dp == 0 else None
    return "offsetting"  # two samples per replica: 4 of 8 samples dropped


SCENARIOS = {
    "aligned": ("raise", 1, _shrink(lambda r, dp: False), {}),
    "drop_one_replica": ("drop", 1, _shrink(lambda r, dp: dp == 0), {}),
    "raise_one_replica": ("raise", 1, _shrink(lambda r, dp: dp == 1), {}),
    "raise_one_rank": ("raise", 1, _shrink(lambda r, dp: r == 3), {}),
    "raise_all": ("raise", 1, _shrink(lambda r, dp: True), {}),
    "encoder_fault": ("repair", 1, _shrink(lambda r, dp: True), {"fail_rank": 1}),
    "metadata_disagreement": ("drop", 1, _shrink(lambda r, dp: False), {"meta_rank": 3}),
    "schedule_desync": ("drop", 1, _shrink(lambda r, dp: False), {"desync": "last_of_stage"}),
    "budget": ("drop", 2, _budget, {"budget": 0.3}),
}


def _batch(dp: int, fault: str | None, step: int):
    from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, inject

    g = TEST_GRAMMARS["qwen"]
    seed = 100 * dp + step
    b = build_batch(g, MEDIA, seed=seed) if fault is None else inject(g, MEDIA, fault, seed=seed)
    feats = b.features(H, seed=seed)
    emb = torch.randn(*b.input_ids.shape, H, generator=torch.Generator().manual_seed(seed))
    return b, emb, feats


def _run_scenario(name, ps, info, groups, log_dir, step0):
    """``groups``: this rank's stage and micro-batch peers (``layout_worker``'s result)."""
    from megatron_media_guard import GuardConfig, MediaGuard, MediaGuardError
    from megatron_media_guard.ranks.budget import DropBudget
    from megatron_media_guard.ranks.consensus import StageConsensus
    from megatron_media_guard.testing import TEST_GRAMMARS

    policy, steps, fault_of, extra = SCENARIOS[name]
    rank, dp = info.rank, info.dp
    stage, peers = groups["stage"], groups["peers"]
    first = ps.is_pipeline_first_stage()
    budget = DropBudget(max_fraction_per_step=extra["budget"]) if "budget" in extra else None
    cons = StageConsensus.from_parallel_state(budget=budget)
    cfg = GuardConfig(policy=policy, fallback="raise", log_dir=log_dir)
    guard = MediaGuard(
        cfg,
        TEST_GRAMMARS["qwen"],
        rank=info,
        consensus=cons,
        geometry=Geo(),
        encoder=_oom if rank == extra.get("fail_rank") else encoder,
    )
    cons.bind(guard)  # proposed for MediaGuard.__init__ (see docs/CONSENSUS.md)
    out = {"error": None, "collectives": [], "dropped": [], "loss_masks": [], "digests": []}
    try:
        for k in range(steps):
            step = step0 + k
            b, emb, feats = _batch(dp, fault_of(rank, dp, k), k)
            items = list(b.items)
            if rank == extra.get("meta_rank") and len(peers) > 1:
                items[0] = replace(items[0], frame_hw=(57, 84))
            if extra.get("fail_rank") is not None:
                items = [replace(it, pixels=torch.rand(3, 6, 6)) for it in items]
            mb = 1 if extra.get("desync") and rank == max(stage) else 0
            lm = torch.ones(b.input_ids.shape)
            if first:
                res = guard.merge(
                    emb, b.input_ids, feats, items, loss_mask=lm, step=step, microbatch=mb
                )
            else:  # the last stage plans from ids and metadata alone
                res = guard.last_stage(b.input_ids, items, loss_mask=lm, step=step, microbatch=mb)
            rep = res.report
            out["dropped"].append(list(rep.dropped))
            out["digests"].append(rep.digest)
            out["collectives"].append(rep.stage.collectives if rep.stage else 0)
            out["loss_masks"].append(res.loss_mask.tolist())
            out["stage_dropped"] = rep.stage.dropped
            guard.on_step_end(step)
    except MediaGuardError as err:
        out.update(error=type(err).__name__, message=str(err), context=dict(err.context), step=step)
    out["total_collectives"] = cons.collectives
    return out


def layout_worker(rank: int, world: int, layout: str, log_root: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_media_guard.ranks.consensus import StageConsensus

    tp, pp, cp = LAYOUTS[layout]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    try:
        info = StageConsensus.from_parallel_state().rank_info()
        res = {"rank": rank, "dp": info.dp, "pp": info.pp, "tp": info.tp, "cp": info.cp}
        res["stage"] = torch.distributed.get_process_group_ranks(
            ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        )
        res["peers"] = torch.distributed.get_process_group_ranks(
            ps.get_tensor_and_context_parallel_group()
        )
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = StageConsensus.from_process_groups(ProcessGroupCollection.use_mpu_process_groups())
        res["pgc"] = [
            torch.distributed.get_process_group_ranks(g)
            for g in (pgc.stage_group, pgc.batch_group, pgc.step_group)
        ]
        res["scenarios"] = {
            name: _run_scenario(name, ps, info, res, f"{log_root}/{name}", 10 * i)
            for i, name in enumerate(SCENARIOS)
        }
        return res
    finally:
        ps.destroy_model_parallel()


# ---- the parent's assertions ------------------------------------------------------


def _stages(results):
    stages: dict[tuple, list] = {}
    for r in results:
        stages.setdefault(tuple(r["stage"]), []).append(r)
    return stages


def _assert_all_raise(results, scenario, culprit_of, error="MediaAlignmentError"):
    for ranks, members in _stages(results).items():
        culprit = culprit_of(ranks, members)
        outs = [m["scenarios"][scenario] for m in members]
        if culprit is None:
            assert all(o["error"] is None for o in outs), (scenario, ranks, outs)
            continue
        for m, o in zip(members, outs):
            assert o["error"] == error, (scenario, m["rank"], o)
            assert f"rank {culprit}" in o["message"], (scenario, m["rank"], o["message"])
            if m["rank"] != culprit:
                assert o["context"]["culprit_rank"] == culprit, (scenario, m["rank"], o)


def _min_rank(pred):
    def culprit(ranks, members):
        hit = [m["rank"] for m in members if pred(m)]
        return min(hit) if hit else None

    return culprit


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_consensus(layout, tmp_path):
    results = run_ranks(layout_worker, 4, args=(layout, str(tmp_path)), timeout=150)
    pp = LAYOUTS[layout][1]
    stages = _stages(results)
    assert len(stages) == pp and all(len(v) == 4 // pp for v in stages.values())
    tp, _, cp = LAYOUTS[layout]
    for r in results:  # micro-batch groups: TP x CP peers, same data-parallel index
        assert len(r["peers"]) == tp * cp and r["rank"] in r["peers"]
        assert {x["dp"] for x in results if x["rank"] in r["peers"]} == {r["dp"]}
        assert r["pgc"][:2] == [r["stage"], r["peers"]]  # ProcessGroupCollection: same groups
        assert len(r["pgc"][2]) == pp
    sc = lambda r, name: r["scenarios"][name]  # noqa: E731

    # aligned: one all-reduce per merge, nothing written by the consensus
    for r in results:
        o = sc(r, "aligned")
        assert o["error"] is None and o["collectives"] == [1], o
    assert not [x for x in records(tmp_path / "aligned") if x["event"] == "consensus"]
    # every rank of a micro-batch group (and the first/last stage pair) holds one digest
    by_dp: dict[int, set] = {}
    for r in results:
        by_dp.setdefault(r["dp"], set()).add(sc(r, "aligned")["digests"][0])
    assert all(len(d) == 1 for d in by_dp.values()), by_dp

    # drop on one replica: no raise; every stage rank sees 1 dropped sample; masks agree
    for r in results:
        o = sc(r, "drop_one_replica")
        assert o["error"] is None and o["collectives"] == [1], o
        assert o["dropped"] == [[0] if r["dp"] == 0 else []]
        assert o["stage_dropped"] == 1
    masks = {}
    for r in results:
        masks.setdefault(r["dp"], []).append(sc(r, "drop_one_replica")["loss_masks"])
    assert all(all(m == ms[0] for m in ms) for ms in masks.values())
    assert masks[0][0][0][0] == [0.0] * len(masks[0][0][0][0])  # sample 0 of dp 0 masked

    _assert_all_raise(results, "raise_one_replica", _min_rank(lambda m: m["dp"] == 1))
    _assert_all_raise(results, "raise_one_rank", _min_rank(lambda m: m["rank"] == 3))
    _assert_all_raise(results, "raise_all", _min_rank(lambda m: True))
    # the encoder fails on rank 1 only: its sample falls back to raise; the stage raises with it.
    # The last stage has no encoder (it assumes the repair succeeded): it does not raise.
    _assert_all_raise(results, "encoder_fault", _min_rank(lambda m: m["rank"] == 1))
    recs = records(tmp_path / "encoder_fault")
    assert "re-encoding failed" in json.dumps([x for x in recs if x["rank"] == 1])
    raised = {r["rank"] for r in results if sc(r, "encoder_fault")["error"]}
    assert raised <= {x["rank"] for x in recs if x["event"] == "consensus"}, raised

    # one rank with different item metadata: the digest catches it (not on PP: a stage's
    # ranks all hold different micro-batches there, nobody to compare with)
    if LAYOUTS[layout][0] * LAYOUTS[layout][2] > 1:
        _assert_all_raise(results, "metadata_disagreement", lambda ranks, ms: 3, "ConsensusError")
        culprit_msg = sc(results[0], "metadata_disagreement")["message"]
        assert "digest" in culprit_msg and "hold the same micro-batch" in culprit_msg
    _assert_all_raise(results, "schedule_desync", lambda ranks, ms: max(ranks), "ConsensusError")

    # budget: step 10*i+0 passes (1 of 8), step 10*i+1 trips (4 of 8 > 30%) on every rank
    step0 = 10 * list(SCENARIOS).index("budget")
    for r in results:
        o = sc(r, "budget")
        assert o["error"] == "DropBudgetExceeded", o
        assert o["step"] == step0 + 1 and "4 of 8 samples" in o["message"], o["message"]
        assert o["context"]["fraction"] == 0.5 and o["context"]["limit"] == 0.3
    tripped = [
        (x["rank"], x["step"]) for x in records(tmp_path / "budget") if x["event"] == "budget"
    ]
    assert sorted(tripped) == [(r, step0 + 1) for r in range(4)]  # one record per rank
