"""StageConsensus and DropBudget: a call's local outcome, the check arithmetic, naming,
single-process defaults, the budget's limits and records, explicit gloo groups on 4 ranks, and
the default consensus of a guard built with no ``consensus=`` in an initialized
torch.distributed job (docs/CONSENSUS.md): a fault on one of 4 gloo ranks makes every rank raise
naming the culprit, the rank from torch.distributed even without ``RANK`` in the environment (a
``spawn`` launch); ``consensus=False`` is the explicit way back to deciding alone."""

from __future__ import annotations

import logging
import os
import sys
import time
import types

import pytest
import torch
from dist_harness import run_ranks
from family_checks import records
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard import (
    ConsensusError,
    DropBudgetExceeded,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
)
from megatron_media_guard.core.outcome import LocalOutcome
from megatron_media_guard.core.plan import ItemRepair, Plan
from megatron_media_guard.diagnostics import RankInfo, get_logger
from megatron_media_guard.ranks.budget import DropBudget
from megatron_media_guard.ranks.consensus import (
    StageConsensus,
    _disagreements,
    check_values,
    coefficients,
    megatron_writers,
)
from megatron_media_guard.testing import TEST_GRAMMARS, inject

Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4)], [("image", 3)], [("image", 5)], [("image", 2)]]


def local(digest=7, fatal=False, step=1, mb=0, dropped=0, samples=4, message=None):
    return LocalOutcome(
        step=step,
        microbatch=mb,
        digest=digest,
        num_samples=samples,
        mismatched=dropped,
        dropped=dropped,
        fatal=fatal,
        fatal_sample=0 if fatal else None,
        message=message,
    )


# ---- LocalOutcome.of_plan: a planned call's outcome, counted from its final plan ---------
REPAIR = ItemRepair(item=1, sample=1, target=4, run=0)
COUNTED = ("digest", "num_samples", "mismatched", "dropped", "repaired", "fatal", "fatal_sample")
RAISED = dict(mismatched=2, message="boom", record={"event": "raise"})


@pytest.mark.parametrize(
    "plan, kw, want",  # want: the COUNTED fields
    [
        (Plan(("keep", "keep"), (), 11), {}, (11, 2, 0, 0, 0, False, None)),
        (
            Plan(("drop", "repair", "keep"), (REPAIR,), 12),
            {"mismatched": 2},
            (12, 3, 2, 1, 1, False, None),
        ),
        (Plan(("keep", "raise", "raise"), (), 13), RAISED, (13, 3, 2, 0, 0, True, 1)),
        # a batch-level fatal (a message, no raising sample): fatal, no sample named
        (Plan(("drop",), (), 14), {"message": "orphans"}, (14, 1, 0, 1, 0, True, None)),
    ],
)
def test_of_plan_counts_the_plan(plan, kw, want):
    out = LocalOutcome.of_plan(plan, 7, 3, **kw)
    assert (out.step, out.microbatch) == (7, 3)
    assert tuple(getattr(out, k) for k in COUNTED) == want
    assert (out.message, out.record) == (kw.get("message"), kw.get("record"))


# ---- the check lanes ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(groups=st.integers(1, 4), size=st.integers(1, 4), data=st.data())
def test_check_lanes_cancel_exactly_when_groups_and_steps_agree(groups, size, data):
    """Simulates the stage's SUM: zero iff every micro-batch group holds one digest and
    every rank one (step, microbatch)."""
    world = groups * size
    stage = list(range(world))
    digests = data.draw(st.lists(st.integers(0, 2), min_size=world, max_size=world))
    steps = data.draw(st.lists(st.sampled_from([(3, 0), (3, 1)]), min_size=world, max_size=world))
    total = [0, 0]
    for r in stage:
        batch = list(range(r // size * size, r // size * size + size))
        coef = (coefficients(r, batch), coefficients(r, stage))
        # group g holds digest base 10*g (+ the drawn deviation): groups never share digests
        vals = check_values(10 * (r // size) + digests[r], min(batch), *steps[r], coef)
        total = [t + v for t, v in zip(total, vals)]
    agree = all(
        len({digests[r] for r in range(g * size, g * size + size)}) == 1 for g in range(groups)
    )
    agree = agree and len(set(steps)) == 1
    assert (total == [0, 0]) == agree
    assert all(abs(v) < 2**62 for v in total)


@pytest.mark.parametrize(
    "rows, culprits, needle",  # rows: (rank, group, digest, microbatch)
    [
        # group of two: the reference is the lowest rank's digest
        ([(0, 0, 5, 0), (1, 0, 6, 0), (2, 2, 9, 0), (3, 2, 9, 0)], [1], "ranks [0, 1] hold"),
        # group of three: the majority wins, even against the lowest rank
        ([(0, 0, 6, 0), (1, 0, 5, 0), (2, 0, 5, 0)], [0], "differ from the majority"),
        ([(0, 0, 5, 0), (1, 0, 5, 0), (2, 2, 9, 0), (3, 2, 8, 0)], [3], "rank 3 digest 0x000000"),
        # a rank at another merge (schedule desync): named with where it is
        ([(0, 0, 1, 0), (1, 1, 1, 0), (2, 2, 1, 1)], [2], "rank 2 at step 4 microbatch 1"),
    ],
)
def test_disagreement_names_the_ranks_that_differ(rows, culprits, needle):
    table = [
        dict(rank=r, group=g, digest=d, fatal=0, sample=-1, step=4, microbatch=m, samples=4)
        for r, g, d, m in rows
    ]
    lines, named = _disagreements(table, local(step=4))
    assert named == culprits
    assert needle in "\n".join(lines) and all("step 4" in line for line in lines)


# ---- single process ---------------------------------------------------------------------


def test_single_process_passes_the_local_outcome_through():
    cons = StageConsensus(rank_info=RankInfo(rank=5))
    assert not cons.active
    out = cons.agree(local(dropped=1))
    assert (out.fatal, out.dropped, out.collectives) == (False, 1, 0)
    bad = cons.agree(local(fatal=True, message="boom"))
    assert bad.fatal and bad.culprit_rank == 5 and bad.message == "boom"
    assert cons.collectives == 0
    totals = cons.on_step_end(1, {"merges": 2})
    assert totals["samples"] == 8 and totals["dropped"] == 1 and totals["merges"] == 2
    assert cons.on_step_end(2, {})["samples"] == 0  # reset at every step end
    assert StageConsensus.from_parallel_state().active is False


def test_guard_with_consensus_and_budget_single_process(tmp_path):
    budget = DropBudget(max_fraction_per_step=0.2)
    cons = StageConsensus(budget=budget)
    guard = MediaGuard(
        GuardConfig(policy="drop", log_dir=str(tmp_path)), Q, rank=RankInfo(rank=0), consensus=cons
    )
    cons.bind(guard)
    batch = inject(Q, LAYOUT, "surplus_feature")
    emb = torch.zeros(*batch.input_ids.shape, 8)
    res = guard.merge(emb, batch.input_ids, batch.features(8), batch.items, step=3)
    assert res.report.dropped == (0,) and res.report.stage.collectives == 0
    with pytest.raises(DropBudgetExceeded) as info:
        guard.on_step_end(3)
    assert "1 of 4 samples" in str(info.value) and "25.00%" in str(info.value)
    assert info.value.context["fraction"] == 0.25 and info.value.context["limit"] == 0.2
    recs = records(tmp_path)
    assert [r["event"] for r in recs] == ["drop", "budget"]  # written before the raise
    assert recs[1]["step"] == 3 and recs[1]["extra"]["tripped"] == "step"


# ---- the drop budget ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_fraction_per_step": -0.1},
        {"max_fraction_per_step": 1.5},
        {"max_fraction_window": True},
        {"max_fraction_window": "0.1"},
        {"window_steps": 0},
        {"window_steps": 2.0},
    ],
)
def test_budget_validation(kwargs):
    with pytest.raises(MediaInputError):
        DropBudget(**kwargs)


@pytest.mark.parametrize(
    "limit, samples, dropped, trips",
    [
        (0.25, 8, 2, False),
        (0.25, 8, 3, True),
        (0.0, 8, 0, False),
        (0.0, 8, 1, True),
        (0.1, 0, 0, False),
    ],
)
def test_budget_per_step_limit(limit, samples, dropped, trips):
    b = DropBudget(max_fraction_per_step=limit)
    if trips:
        with pytest.raises(DropBudgetExceeded, match=f"{dropped} of {samples} samples"):
            b.on_step_end(0, {"samples": samples, "dropped": dropped})
    else:
        assert b.on_step_end(0, {"samples": samples, "dropped": dropped}).tripped is None


def test_budget_window_needs_a_full_window_then_trips():
    b = DropBudget(max_fraction_window=0.1, window_steps=3)
    assert b.on_step_end(10, {"samples": 10, "dropped": 5}).tripped is None  # 1 step seen
    assert b.on_step_end(11, {"samples": 10, "dropped": 0}).window_fraction == 0.25
    with pytest.raises(DropBudgetExceeded) as info:
        b.on_step_end(12, {"samples": 10, "dropped": 0})  # 5 / 30 over steps 10..12
    msg = str(info.value)
    assert "5 of 30 samples" in msg and "last 3 steps (steps 10..12" in msg and "10.00%" in msg
    assert info.value.context["tripped"] == "window"
    b.reset()
    assert b.on_step_end(13, {"samples": 10, "dropped": 5}).window_steps == 1


def test_budget_slides_the_window():
    b = DropBudget(max_fraction_window=0.2, window_steps=2)
    b.on_step_end(0, {"samples": 10, "dropped": 3})
    b.on_step_end(1, {"samples": 10, "dropped": 1})  # 4 / 20 = 0.2: equal passes
    s = b.on_step_end(2, {"samples": 10, "dropped": 1})  # step 0 left the window
    assert (s.window_dropped, s.window_samples, s.tripped) == (2, 20, None)


def test_budget_logs_counters_to_megatron_writers(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars", raising=False)
    assert megatron_writers() == ()  # no Megatron-LM: no writers
    tb, wb = types.SimpleNamespace(seen=[]), types.SimpleNamespace(seen=[])
    tb.add_scalar = lambda tag, value, step: tb.seen.append((tag, value, step))  # TensorBoard
    wb.log = lambda scalars, step: wb.seen.append((dict(scalars), step))  # W&B
    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_tensorboard_writer = lambda: tb
    gv.get_wandb_writer = lambda: wb
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    assert megatron_writers() == (tb, wb)
    cons = StageConsensus(budget=DropBudget(max_fraction_per_step=0.5))
    cons.agree(local(dropped=1, samples=4))
    cons.on_step_end(9, {"merges": 1})
    want = dict(samples=4.0, dropped=1.0, mismatched=1.0, repaired=0.0, drop_fraction=0.25)
    want = {f"media_guard/{k}": v for k, v in {**want, "drop_fraction_window": 0.25}.items()}
    assert wb.seen == [(want, 9)]
    assert sorted(tb.seen) == sorted((tag, v, 9) for tag, v in want.items())


# ---- explicit gloo groups, 4 ranks ----------------------------------------------------------


def explicit_worker(rank: int, world: int) -> dict:
    """TP2 x DP2 built by hand: stage = world, micro-batch groups {0, 1} and {2, 3}."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cons = StageConsensus(stage_group=None, batch_group=groups[rank // 2])
    out = {"info": cons.rank_info().rank, "size": (cons.stage_size, cons.batch_size)}
    digest = 100 + rank // 2
    s = cons.agree(local(digest=digest, dropped=int(rank < 2)))
    out["aligned"] = (s.fatal, s.dropped, s.collectives)
    s = cons.agree(local(digest=digest, fatal=rank == 2, message=f"from {rank}"))
    out["fatal"] = (s.fatal, s.culprit_rank, s.message, s.collectives)
    try:
        cons.agree(local(digest=digest + (rank == 1)))
        out["disagree"] = None
    except ConsensusError as err:
        out["disagree"] = (err.context["culprit_rank"], str(err))
    out["totals"] = cons.on_step_end(1, {})
    out["collectives"] = cons.collectives
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_explicit_groups_on_four_ranks():
    res = run_ranks(explicit_worker, 4, timeout=90)
    for r, o in enumerate(res):
        assert o["info"] == r and o["size"] == (4, 2)
        assert o["aligned"] == (False, 1, 1)  # 2 peers x 1 drop, counted once
        assert o["fatal"] == (True, 2, "from 2", 3)  # the culprit's message, on every rank
        assert o["disagree"][0] == 1 and "rank 1 digest" in o["disagree"][1]
        assert o["totals"]["samples"] == 3 * 8 and o["totals"]["dropped"] == 1
        assert o["collectives"] == 1 + 3 + 2


def sleepy_worker(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(120)


def raising_worker(rank: int, world: int) -> None:
    if rank == 0:
        raise RuntimeError("rank zero broke")
    torch.distributed.barrier()  # the others wait for rank 0 forever


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_harness_fails_a_hang_and_an_error_within_its_bound():
    with pytest.raises(AssertionError, match=r"ranks \[1\] of 2 still running"):
        # 25 s: rank 0 must have started and returned by then, even on a loaded 2-core machine
        # (12 s was once too short at load 15); rank 1 sleeps far past it
        run_ranks(sleepy_worker, 2, timeout=25)
    with pytest.raises(AssertionError, match=r"rank 0 failed first:(.|\n)*rank zero broke"):
        run_ranks(raising_worker, 2, timeout=20)


def bad_input_worker(rank: int, world: int) -> dict:
    """Rank 3 passes features of the wrong hidden size: it fails before its collective, but
    still joins it, so every rank raises naming rank 3 instead of waiting for a timeout."""
    batch = inject(Q, LAYOUT, "none")
    guard = MediaGuard(
        GuardConfig(), grammar=Q, rank=RankInfo(rank=rank), consensus=StageConsensus()
    )
    h = 8
    feats = batch.features(h + (rank == 3))
    emb = torch.randn(*batch.input_ids.shape, h)
    try:
        guard.merge(emb, batch.input_ids, feats, batch.items, step=1)
    except MediaInputError as err:
        return {"own": True, "msg": str(err)}
    except Exception as err:  # the peers' error names the culprit
        return {
            "own": False,
            "type": type(err).__name__,
            "msg": str(err),
            "ctx": err.context.get("culprit_rank"),
        }
    return {"own": None}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_error_before_the_collective_still_joins_it():
    res = run_ranks(bad_input_worker, 4, timeout=90)
    assert res[3]["own"] is True and "hidden size" in res[3]["msg"]
    for o in res[:3]:
        assert o["own"] is False and o["ctx"] == 3 and "hidden size" in o["msg"]


# ---- the default consensus: no consensus= argument, 4 ranks ----------------------------------
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
@pytest.mark.parametrize("mode", ["world", "parallel_state", "off"])
def test_every_rank_raises_naming_the_culprit_without_a_consensus_argument(tmp_path, mode):
    """``consensus=False`` ("off") is the explicit way back to deciding per rank: no
    announcement, and only the culprit raises."""
    res = run_ranks(default_worker, 4, args=(str(tmp_path), mode), timeout=120)
    on = mode != "off"
    assert [r["rank"] for r in res] == [0, 1, 2, 3]  # from torch.distributed, RANK unset
    assert [r["consensus"] for r in res] == [on] * 4
    source = "parallel_state" if mode == "parallel_state" else "the world group"
    for r in res:  # one line per process, saying which groups
        assert len(r["announced"]) == on and all(source in m for m in r["announced"]), r
    if mode == "parallel_state":
        assert [r["tp"] for r in res] == [0, 1, 0, 1]
    raising = [r for r in res if r["error"] is not None]
    assert [r["rank"] for r in raising] == ([0, 1, 2, 3] if on else [CULPRIT])
    for r in raising:
        assert r["culprit"] == CULPRIT and f"rank {CULPRIT}" in r["error"]
    recs = records(tmp_path)
    raised = [r for r in recs if r["event"] == "raise"]
    assert [r["rank"] for r in raised] == [CULPRIT]  # the culprit's own record, not "rank ?"
    consensus = sorted(r["rank"] for r in recs if r["event"] == "consensus")
    assert consensus == ([0, 1, 2, 3] if on else [])
