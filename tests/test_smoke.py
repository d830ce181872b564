"""``media-guard smoke``: the scenario stream, the tiny model, the launcher, and 4-rank runs
whose per-rank JSONL must hold exactly what the smoke injected."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from family_checks import records

from megatron_media_guard.core.alignment import check_alignment
from megatron_media_guard.diagnostics.report import summarize
from megatron_media_guard.smoke import EXIT_USAGE, main
from megatron_media_guard.smoke.expect import expected, mismatches, observed
from megatron_media_guard.smoke.runspec import Observation
from megatron_media_guard.smoke.scenarios import (
    FAULT_SPECS,
    GEOMETRY,
    GRAMMAR,
    SCENARIOS,
    micro_batch,
)
from megatron_media_guard.testing import FAULTS

ROOT = Path(__file__).resolve().parents[1]


# ---- the scenario stream (no torch.distributed) ------------------------------------------
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_fault_breaks_exactly_the_samples_it_names(scenario):
    spec = FAULT_SPECS[scenario]
    mb = micro_batch(scenario, dp_rank=1, step=1)
    rep = check_alignment(mb.input_ids, mb.items(), GRAMMAR)
    found = {s.sample: str(s.status) for s in rep.mismatched}
    assert found == dict(zip(spec.samples, spec.statuses))
    assert mb.faulty_samples == spec.samples
    assert not rep.orphans and not rep.stray_findings
    clean = micro_batch("none", dp_rank=1, step=1)
    assert check_alignment(clean.input_ids, clean.items(), GRAMMAR).ok


def test_every_synthetic_fault_is_a_smoke_scenario():
    assert set(SCENARIOS) == set(FAULTS) and SCENARIOS[0] == "none"


def test_peers_of_one_data_parallel_rank_get_identical_batches_and_others_differ():
    a, b = micro_batch("budget_shrink", 2, 1), micro_batch("budget_shrink", 2, 1)
    assert torch.equal(a.input_ids, b.input_ids) and a.media == b.media
    assert all(torch.equal(x, y) for x, y in zip(a.pixels(), b.pixels()))
    others = [micro_batch("none", d, 0) for d in range(4)]
    assert len({tuple(m.media) for m in others}) > 1


# ---- the tiny model, single process -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("megatron.core")
    from megatron_media_guard.smoke.model import TinyVLM, single_process_parallel_state

    with single_process_parallel_state():
        torch.manual_seed(0)
        yield TinyVLM()


@pytest.mark.parametrize(
    ("hw", "frames"), [((40, 56), 1), ((30, 70), 1), ((32, 48), 4), ((24, 40), 6)]
)
def test_vision_tower_yields_the_geometry_token_count(tiny, hw, frames):
    size = GEOMETRY.size_for(hw, frames)
    px = torch.randn(3, *size) if frames == 1 else torch.randn(frames, 3, *size)
    out = tiny.encode(px)
    assert out.shape == (GEOMETRY.tokens(hw, frames), tiny.size.hidden)


def _guard(policy):
    from megatron_media_guard import GuardConfig, MediaGuard

    return MediaGuard(GuardConfig(policy=policy), GRAMMAR, geometry=GEOMETRY)


def _step(model, mb, policy):
    model.zero_grad()
    loss, res = model(mb, _guard(policy), 0, mb.pixels())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, res, grads


def test_tiny_model_trains_and_a_dropped_sample_leaves_the_others_untouched(tiny):
    from megatron_media_guard.smoke.model import next_token_targets

    clean = micro_batch("none", 0, 0)
    loss, res, grads = _step(tiny, clean, "drop")
    assert torch.isfinite(loss) and res.report.dropped == ()
    for part in ("vision.embed.weight", "projector.", "embedding.word_embeddings.weight", "head."):
        assert any(n.startswith(part) and g.abs().sum() > 0 for n, g in grads.items()), part

    faulty = micro_batch("budget_shrink", 0, 0)  # sample 1's video was shrunk by the engine
    loss_d, res_d, grads_d = _step(tiny, faulty, "drop")
    assert res_d.report.dropped == (1,)
    assert res_d.loss_mask[1].sum() == 0 and (res_d.labels[1] == -100).all()
    assert "vision.embed.weight" in grads_d  # zero-weight anchor keeps the tower in the graph
    # rows 0, 2, 3 are the clean batch's: the loss is the clean loss with sample 1 masked out
    assert faulty.input_ids[[0, 2, 3]].equal(clean.input_ids[[0, 2, 3]])
    mask = next_token_targets(clean.input_ids)[1]
    mask[1] = 0
    with torch.no_grad():
        ref, _ = tiny(clean, _guard("drop"), 0, clean.pixels(), loss_mask=mask)
    assert float(loss_d) == pytest.approx(float(ref), rel=1e-5)
    assert float(loss_d) != pytest.approx(float(loss), rel=1e-5)

    before = [p.detach().clone() for p in tiny.parameters()]
    torch.optim.SGD(tiny.parameters(), lr=0.1).step()
    assert any(not torch.equal(a, p) for a, p in zip(before, tiny.parameters()))


def test_repair_reprojects_the_shrunk_video_to_the_engine_count(tiny):
    mb = micro_batch("budget_shrink", 0, 0)
    loss, res, _ = _step(tiny, mb, "repair")
    assert res.report.repaired == (1,) and res.report.dropped == ()
    assert torch.isfinite(loss) and res.loss_mask[1].sum() > 0


# ---- expectations and the table ----------------------------------------------------------
def _obs(rank, **kw):
    base = dict(scenario="budget_shrink", policy="drop", rank=rank, steps_done=2)
    base.update(losses=(7.0, 6.9), drops=(), repairs=(), injected=())
    return Observation(**{**base, **kw})


def test_a_drop_on_the_wrong_rank_is_a_mismatch():
    want = expected("budget_shrink", "drop", [0, 1, 2, 3], fault_rank=1, fault_step=1, steps=2)
    by_rank = {r: {"step": 2} for r in range(4)}
    by_rank[1]["drop"] = 1
    right = [_obs(r, drops=((1, (1,)),) if r == 1 else ()) for r in range(4)]
    assert mismatches(want, observed(right, by_rank)) == []
    wrong = [_obs(r, drops=((1, (1,)),) if r == 2 else ()) for r in range(4)]
    problems = mismatches(want, observed(wrong, by_rank))
    assert len(problems) == 1 and problems[0].startswith("drops: expected ((1, 1, (1,)),)")
    nan = [_obs(r, losses=(float("nan"),)) if r == 3 else right[r] for r in range(4)]
    assert [p.split(":")[0] for p in mismatches(want, observed(nan, by_rank))] == ["loss_finite"]


def test_raise_expectation_names_the_lowest_rank_of_the_faulty_micro_batch_group():
    # TP2 x DP2: ranks 0, 1 hold dp 0; the fault on rank 1 is raised as rank 0's
    want = expected("budget_shrink", "raise", [0, 0, 1, 1], fault_rank=1, fault_step=1, steps=3)
    assert want.culprit == (0,) and want.raised_ranks == (0, 1, 2, 3)
    assert ((0, "raise", 1) in want.events) and ((1, "raise", 1) in want.events)
    assert (2, "raise", 1) not in want.events and (3, "consensus", 1) in want.events
    alone = expected("budget_shrink", "raise", [0], fault_rank=0, fault_step=1, steps=3)
    assert alone.events == ((0, "raise", 1), (0, "step", 1))  # a one-rank stage: no consensus


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp", "3"],
        ["--nproc", "0"],
        ["--scenario", "no_such_fault"],
        ["--policy", "ignore"],
        ["--fault-rank", "4"],
        ["--steps", "2", "--fault-step", "2"],
        ["--backend", "nccl", "--nproc", "64"],
    ],
)
def test_usage_errors_exit_2_without_launching(argv, capsys):
    assert main(argv) == EXIT_USAGE
    assert "media-guard smoke" in capsys.readouterr().err


# ---- the launcher (torch elastic, forkserver ranks: no megatron) ----------------------------
# The entries are module-level (pickled by name). Bounds on a hang: the launcher's own timeout,
# and the test's hard timeout.


def _rank_1_fails(how):
    """Rank 1 hangs (``how``: "hang") or raises; rank 0 returns its result."""
    rank = int(os.environ["RANK"])
    if rank == 1 and how == "hang":
        time.sleep(600)
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return types.SimpleNamespace(rank=rank)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how, start_method, needles",
    [
        ("hang", "forkserver", ["timed out after 4 s"]),
        ("boom", "forkserver", ["rank 1", "boom on purpose"]),
        ("boom", "spawn", ["rank 1", "boom on purpose"]),
    ],
)
def test_launcher_stops_a_hang_and_names_the_rank_that_failed(how, start_method, needles):
    from megatron_media_guard.smoke.launch import LaunchError, LaunchSpec, launch

    timed_out = how == "hang"
    spec = LaunchSpec(2, timeout_s=4 if timed_out else 60, start_method=start_method, preload=())
    with pytest.raises(LaunchError) as info:
        launch(spec, how, entry=_rank_1_fails)
    assert info.value.timed_out is timed_out and not info.value.interrupted
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_launcher_refuses_fork():
    from megatron_media_guard.smoke.launch import LaunchError, LaunchSpec

    with pytest.raises(LaunchError, match="'fork'"):
        LaunchSpec(2, timeout_s=4, start_method="fork")


# ---- 4-rank smoke runs ------------------------------------------------------------------------
def _smoke(tmp_path, *flags):
    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "megatron_media_guard.smoke", "--log-dir", str(log_dir), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    return proc, log_dir


def _records(run_dir: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rec in records(run_dir):
        out.setdefault(rec["rank"], []).append(rec)
    return out


def _events(recs: list[dict]) -> Counter:
    return Counter(r["event"] for r in recs)


def _of(recs: dict[int, list[dict]], event: str, *keys: str) -> list[tuple]:
    """``keys`` of every ``event`` record of every rank, sorted."""
    return sorted(
        tuple(r[k] for k in keys) for x in recs.values() for r in x if r["event"] == event
    )


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_smoke_four_ranks_every_policy_logs_exactly_what_was_injected(tmp_path):
    pytest.importorskip("megatron.core")
    proc, logs = _smoke(
        tmp_path, "--scenario", "none,budget_shrink,offsetting", "--policy", "all", "--steps", "2"
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "PASSED" in out and "MISMATCH" not in out
    assert out.count("[smoke]") >= 9 * 2  # a progress line per scenario/step from rank 0
    row = r"budget_shrink\s+raise\s+all 4 raised at step 1 naming rank 1\s+all 4 raised at step 1 naming rank 1\s+ok"
    assert re.search(row, out), out

    # fault on rank 1 (data-parallel rank 1) at step 1, two steps per run
    for policy in ("raise", "drop", "repair"):
        recs = _records(logs / f"none.{policy}")
        assert {r: dict(_events(x)) for r, x in recs.items()} == {r: {"step": 2} for r in range(4)}

    recs = _records(logs / "budget_shrink.raise")
    (fatal,) = [r for r in recs[1] if r["event"] == "raise"]
    assert (fatal["step"], fatal["sample"], fatal["sample_id"]) == (1, 1, "dp1-step1-s1")
    assert fatal["modality"] == "video" and fatal["got"][0] > fatal["expected"][0]
    for rank in range(4):
        ev = _events(recs[rank])
        assert ev["raise"] == (1 if rank == 1 else 0) and ev["step"] == 1
        (cons,) = [r for r in recs[rank] if r["event"] == "consensus"]
        assert cons["action"] == "raise" and cons["extra"]["culprit_ranks"] == [1]

    recs = _records(logs / "budget_shrink.drop")
    assert _of(recs, "drop", "rank", "step", "sample") == [(1, 1, 1)]
    assert all(_events(x)["step"] == 2 and not _events(x)["raise"] for x in recs.values())

    recs = _records(logs / "budget_shrink.repair")
    (rep,) = [r for x in recs.values() for r in x if r["event"] == "repair"]
    assert (rep["rank"], rep["step"], rep["item"], rep["action"]) == (1, 1, 1, "repair")
    assert rep["fidelity"] == "engine-replay" and rep["expected"][0] < rep["got"][0]
    assert not any(r["event"] in ("drop", "raise") for x in recs.values() for r in x)

    # +1 and -1: equal batch totals, both caught
    recs = _records(logs / "offsetting.drop")
    assert _of(recs, "drop", "rank", "step", "sample") == [(1, 1, 0), (1, 1, 2)]
    recs = _records(logs / "offsetting.repair")
    assert _of(recs, "repair", "rank", "item", "action") == [(1, 0, "repair"), (1, 2, "repair")]

    summary = summarize(logs / "offsetting.raise")
    assert summary.by_rank[1]["raise"] == 2 and summary.count("consensus") == 4
    assert summary.first_fatal is not None and summary.first_fatal["rank"] == 1


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_smoke_tensor_parallel_peers_raise_and_drop_together(tmp_path):
    pytest.importorskip("megatron.core")
    flags = ["--tp", "2", "--scenario", "swapped_items", "--policy", "raise,drop", "--steps", "2"]
    proc, logs = _smoke(tmp_path, *flags)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # rank 1's tensor-parallel peer is rank 0: both hold the faulty micro-batch of dp rank 0
    recs = _records(logs / "swapped_items.raise")
    assert [r for r in range(4) if _events(recs[r])["raise"]] == [0, 1]
    for rank in range(4):
        (cons,) = [r for r in recs[rank] if r["event"] == "consensus"]
        assert cons["extra"]["culprit_ranks"] == [0, 1]
    assert _of(_records(logs / "swapped_items.drop"), "drop", "rank", "sample") == [(0, 2), (1, 2)]
    assert "all 4 raised at step 1 naming rank 0" in proc.stdout
