"""The first and last pipeline stages reach the same plan without communicating.

Megatron gives both stages the micro-batch; only the first has vision features. The
first stage runs the guarded merge; the last stage runs ``MediaGuard.last_stage`` on the
token ids, item metadata, loss mask and labels. They must agree on every sample's
action and the plan digest, and the last stage's loss mask / labels must drop
exactly the samples the first stage dropped.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_media_guard import (
    Grammar,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.core.plan import digest, item_signature, plan_digest_of
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.geometry import Solution
from megatron_media_guard.testing import FAULTS, TEST_GRAMMARS, build_batch, inject, random_layout

Q = TEST_GRAMMARS["qwen"]
H = 8
LAYOUT = [[("image", 4), ("image", 6)], [("image", 3)], [("video", 8)], [("image", 5)]]


def stages(grammar, policy="drop", **kw):
    cfg = GuardConfig(policy=policy, **kw)
    first = MediaGuard(cfg, grammar=grammar, rank=RankInfo(rank=0, pp=0))
    last = MediaGuard(cfg, grammar=grammar, rank=RankInfo(rank=1, pp=1))
    return first, last


def run_both(first, last, ids, items, feats, cu=None, lm=None, **kw):
    b, s = ids.shape
    lm = torch.ones(b, s) if lm is None else lm
    labels = torch.roll(ids, -1, dims=1)
    emb = torch.randn(b, s, H)
    res = first.merge(emb, ids, feats, items, loss_mask=lm, labels=labels, cu_seqlens=cu, **kw)
    lp = last.last_stage(ids, items, loss_mask=lm, labels=labels, cu_seqlens=cu, **kw)
    return res, lp


def assert_same(res, lp):
    assert lp.report.actions == res.report.actions
    assert lp.report.digest == res.report.digest
    assert lp.report.dropped == res.report.dropped
    assert torch.equal(lp.loss_mask, res.loss_mask)
    assert torch.equal(lp.labels, res.labels)


@pytest.mark.parametrize("grammar", ["qwen", "internvl", "pixtral", "plain"])
@pytest.mark.parametrize("fault", FAULTS)
def test_first_and_last_stage_agree_under_drop(grammar, fault):
    g = TEST_GRAMMARS[grammar]
    layout = [[(m if m in g.placeholders else "image", n) for m, n in smp] for smp in LAYOUT]
    batch = inject(g, layout, fault)
    first, last = stages(g)
    # the media's placeholders are not trained on (a placeholder under the loss outside a
    # region was generated, fed as text: test_generated.py)
    lm = (~torch.isin(batch.input_ids, torch.tensor(list(g.placeholders.values())))).float()
    res, lp = run_both(first, last, batch.input_ids, batch.items, batch.features(H), lm=lm)
    assert_same(res, lp)
    for smp in range(batch.input_ids.shape[0]):
        dropped = smp in lp.report.dropped
        assert bool(lp.loss_mask[smp].eq(0).all()) == dropped
        assert bool(lp.labels[smp].eq(-100).all()) == dropped
    if fault != "none":
        assert lp.report.dropped, "every fault here drops at least one sample"
    assert first.counters == last.counters


def test_packed_samples_agree():
    a = build_batch(Q, [[("image", 3)]])
    b = build_batch(Q, [[("image", 5)]], seed=1)
    ids = torch.cat([a.input_ids, b.input_ids], dim=1)
    cu = torch.tensor([0, a.input_ids.shape[1], ids.shape[1]])
    items = [MediaItem(3, 0), MediaItem(6, 1)]  # sample 1: one feature too many
    first, last = stages(Q)
    res, lp = run_both(first, last, ids, items, torch.randn(9, H), cu)
    assert_same(res, lp)
    assert lp.report.dropped == (1,)
    assert lp.loss_mask[0, : cu[1]].eq(1).all() and lp.loss_mask[0, cu[1] :].eq(0).all()


def test_raise_policy_raises_on_both_stages_naming_the_sample():
    batch = inject(Q, LAYOUT, "budget_shrink")
    first, last = stages(Q, "raise")
    emb, ids = torch.randn(*batch.input_ids.shape, H), batch.input_ids
    for call in (
        lambda: first.merge(emb, ids, batch.features(H), batch.items, step=7),
        lambda: last.last_stage(ids, batch.items, step=7),
    ):
        with pytest.raises(MediaAlignmentError) as info:
            call()
        assert all(s in str(info.value) for s in ("step 7", "sample 0", "'s0'")), info.value


class Geo:
    """Any target is reached, uniquely, by a ``target x 2`` frame."""

    def solve(self, target, hw, num_frames=1, *, hw_kind="source"):
        return Solution(target, (target, 2), "unique", "stub", None)


def encoder(px: torch.Tensor) -> torch.Tensor:
    """``[C, n, 2]`` pixels -> ``[n, H]`` features."""
    return px.mean(dim=(0, 2)).unsqueeze(1).expand(-1, H).contiguous()


def test_repair_digest_matches_when_the_repair_succeeds():
    batch = inject(Q, LAYOUT, "budget_shrink")
    items = [replace(it, pixels=torch.rand(3, 6, 6)) for it in batch.items]
    cfg = GuardConfig(policy="repair", fallback="drop")
    first = MediaGuard(cfg, grammar=Q, geometry=Geo(), encoder=encoder)
    last = MediaGuard(cfg, grammar=Q)  # no vision tower on the last stage
    res, lp = run_both(first, last, batch.input_ids, items, batch.features(H))
    assert res.report.actions[0] == "repair" and res.report.repaired
    assert lp.report.actions == res.report.actions and lp.report.digest == res.report.digest
    assert lp.loss_mask.eq(1).all()


def test_a_single_stage_without_features_attempts_its_repairs():
    """repairs="attempt" (check_batch, the input rewrite): with no geometry every planned
    repair falls back with the merge's reason; "assume" (the last stage) takes the first
    stage's success on trust."""
    batch = inject(Q, LAYOUT, "budget_shrink")
    cfg = GuardConfig(policy="repair", fallback="drop")
    with pytest.warns(UserWarning, match="no mismatch can be repaired"):
        guard = MediaGuard(cfg, grammar=Q)
    lone = guard.last_stage(batch.input_ids, batch.items, repairs="attempt")
    last = guard.last_stage(batch.input_ids, batch.items)
    assert lone.report.actions[0] == "drop" and not lone.report.repaired
    assert last.report.actions[0] == "repair" and last.report.repaired
    emb = torch.randn(*batch.input_ids.shape, H)
    first = guard.merge(emb, batch.input_ids, batch.features(H), batch.items)
    assert first.report.actions == lone.report.actions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    fault=st.sampled_from(FAULTS),
    policy=st.sampled_from(["drop", "raise"]),
    grammar=st.sampled_from(["qwen", "internvl", "pixtral"]),
)
def test_property_stages_agree(seed, fault, policy, grammar):
    g = TEST_GRAMMARS[grammar]
    rng = random.Random(seed)
    layout = random_layout(rng, rng.randint(1, 4), max_items=3, max_len=6)
    try:
        batch = inject(g, layout, fault, seed=seed)
    except ValueError:  # the fault does not fit this layout
        assume(False)
    first, last = stages(g, policy)
    emb, ids = torch.zeros(*batch.input_ids.shape, H), batch.input_ids
    outs = []
    for plan in (
        lambda: first.merge(emb, ids, batch.features(H), batch.items),
        lambda: last.last_stage(ids, batch.items),
    ):
        try:
            res = plan()
            outs.append((res.report.actions, res.report.digest, res.loss_mask))
        except MediaAlignmentError as err:
            outs.append(("raise", err.context.get("sample")))
    a, b = outs
    assert a[:2] == b[:2]
    if a[0] != "raise":
        assert (a[2] is None and b[2] is None) or torch.equal(a[2], b[2])


@pytest.mark.parametrize(
    "grammar, shape, match",
    [(Grammar.llava(), None, "collapsed"), (Q, (1, 3), r"loss_mask must be \[b, s\]")],
)
def test_last_stage_rejects_what_it_cannot_plan(grammar, shape, match):
    ids = torch.tensor([[1000, 5, 5, 1001]])
    lm = torch.ones(shape) if shape else None
    with pytest.raises(MediaInputError, match=match):
        MediaGuard(GuardConfig(), grammar=grammar).last_stage(ids, [MediaItem(2, 0)], loss_mask=lm)


@settings(max_examples=60, deadline=None)
@given(
    fp=st.integers(-(2**63), 2**63 - 1),
    runs=st.integers(0, 50),
    lens=st.lists(st.integers(0, 9), max_size=5),
    actions=st.lists(st.sampled_from(["keep", "drop", "repair", "raise"]), max_size=4),
    repairs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 99)), max_size=3),
)
def test_cached_plan_digest_hashes_the_same_bytes(fp, runs, lens, actions, repairs):
    """The digest with the item signature's JSON cached is the plain digest of the parts."""
    items = [MediaItem(n, modality="image" if n % 2 else "video") for n in lens]
    knobs = ["drop", "raise", "raise", ["exact"]]
    for _ in range(2):  # encoded, then from the cache
        got = plan_digest_of(fp, runs, items, knobs, actions, repairs)
        assert got == digest(fp, runs, item_signature(items), knobs, actions, repairs)
