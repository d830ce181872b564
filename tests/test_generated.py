"""Placeholders the policy generated (RL rollouts): under the loss and outside every region
they are text, not media (``GuardConfig.generated``), in ``MediaGuard.merge`` and its last
pipeline stage (the knob through the environment and the launcher: tests/test_config_env.py)."""

from __future__ import annotations

import random

import pytest
import torch
from family_checks import records
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan_determinism import assert_same, stages

from megatron_media_guard import (
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
)
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch, random_layout

H = 8
Q = TEST_GRAMMARS["qwen"]
LAYOUT = [[("image", 4)], [("image", 2)], [("image", 3)]]
RESPONSE = 3  # the last text tokens of each row: the response, under the loss


def rollout(grammar=Q, layout=LAYOUT, sample=1, n=2, seed=0):
    """An aligned batch, its batch with ``n`` placeholders the policy wrote in ``sample``'s
    response, and the loss of a rollout: labels (ignore elsewhere) and loss mask over each
    row's response."""
    clean = build_batch(grammar, layout, text=RESPONSE, seed=seed)
    ids = clean.input_ids
    b, s = ids.shape
    ends = (ids != 0).sum(1)  # rows are right-padded with 0
    col = torch.arange(s).expand(b, s)
    resp = (col >= (ends - RESPONSE)[:, None]) & (col < ends[:, None])
    labels = ids.masked_fill(~resp, -100)
    bad = ids.clone()
    end = int(ends[sample])
    at = list(range(end - n, end))
    bad[sample, at] = next(iter(grammar.placeholders.values()))
    return clean, bad, labels, resp.float(), at


def merge(guard, ids, batch, emb, **kw):
    return guard.merge(emb, ids, batch.features(H), batch.items, **kw)


def guard(policy="drop", generated="text", grammar=Q, **kw):
    return MediaGuard(GuardConfig(policy=policy, generated=generated, **kw), grammar)


@pytest.mark.parametrize("policy", ["raise", "drop", "repair"])
@pytest.mark.parametrize("signal", ["labels", "loss_mask", "both"])
def test_fed_as_text_keeps_the_sample_bit_identical(policy, signal, tmp_path):
    clean, bad, labels, lm, at = rollout()
    emb = torch.randn(*bad.shape, H)
    kw = {
        "labels": {"labels": labels},
        "loss_mask": {"loss_mask": lm},
        "both": {"labels": labels, "loss_mask": lm},
    }[signal]
    g = guard(policy, log_dir=str(tmp_path))
    res = merge(g, bad, clean, emb, **kw)
    by_hand = bad.clone()
    by_hand[1, at] = Q.text_id  # the text id fed there by hand: the aligned batch
    ref = merge(guard(policy), by_hand, clean, emb, **kw)
    assert res.report.actions == ("keep",) * 3 and res.report.dropped == ()
    assert torch.equal(res.embeddings, ref.embeddings)
    assert torch.equal(res.embeddings[1, at], emb[1, at])  # nothing scattered there
    for got, want in ((res.labels, kw.get("labels")), (res.loss_mask, kw.get("loss_mask"))):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
    assert res.report.generated == ((1, tuple(at)),)
    g.close()
    fed = [r for r in records(tmp_path) if r["action"] == "text"]
    assert [(r["event"], r["sample"], r["extra"]["positions"]) for r in fed] == [("check", 1, at)]
    assert fed[0]["reason"].startswith("generated placeholder fed as text")


@pytest.mark.parametrize("policy", ["raise", "drop", "repair"])
def test_generated_drop_drops_only_that_sample(policy):
    clean, bad, labels, lm, _at = rollout()
    emb = torch.randn(*bad.shape, H)
    res = merge(guard(policy, "drop"), bad, clean, emb, labels=labels, loss_mask=lm)
    ref = merge(guard(policy), clean.input_ids, clean, emb, labels=labels, loss_mask=lm)
    assert res.report.actions == ("keep", "drop", "keep")
    assert res.loss_mask[1].eq(0).all() and res.labels[1].eq(-100).all()
    assert torch.equal(res.embeddings[1], emb[1])  # no feature merged into it
    for smp in (0, 2):
        assert torch.equal(res.embeddings[smp], ref.embeddings[smp])
        assert torch.equal(res.labels[smp], labels[smp])


@pytest.mark.parametrize("policy", ["raise", "drop", "repair"])
def test_generated_raise_names_sample_and_positions(policy):
    clean, bad, labels, _, at = rollout()
    with pytest.raises(MediaAlignmentError) as err:
        merge(guard(policy, "raise"), bad, clean, torch.randn(*bad.shape, H), labels=labels)
    msg = str(err.value)
    assert "1 of 3 samples" in msg and "sample 1 (sample_id 's1') row 1: generated" in msg
    assert f"positions {at}" in msg and "generated='raise'" in msg


@pytest.mark.parametrize("generated", ["text", "drop", "raise"])
@pytest.mark.parametrize(
    ("policy", "outcome"), [("drop", ("keep", "drop", "keep")), ("raise", None)]
)
def test_without_labels_or_loss_mask_nothing_changes(generated, policy, outcome):
    clean, bad, *_ = rollout()
    emb = torch.randn(*bad.shape, H)
    if outcome is None:
        with pytest.raises(MediaAlignmentError, match="outside_region"):
            merge(guard(policy, generated), bad, clean, emb)
        return
    res = merge(guard(policy, generated), bad, clean, emb)
    assert res.report.actions == outcome and res.report.generated == ()


def test_placeholders_inside_a_region_under_the_loss_stay_media():
    """SFT that trains on the prompt too: the media's own placeholders are under the labels,
    inside their regions; only the stray one outside a region is generated."""
    clean, bad, labels, _, at = rollout()
    labels = bad.clone()  # every position trained on
    res = merge(guard("raise"), bad, clean, torch.randn(*bad.shape, H), labels=labels)
    assert res.report.actions == ("keep",) * 3 and res.report.generated == ((1, tuple(at)),)


@pytest.mark.parametrize("name", ["pixtral", "plain"])
def test_grammars_without_markers_read_the_loss_alone(name):
    g = TEST_GRAMMARS[name]
    clean, bad, _labels, lm, at = rollout(g)
    emb = torch.randn(*bad.shape, H)
    res = merge(guard("raise", grammar=g), bad, clean, emb, loss_mask=lm)
    ref = merge(guard("raise", grammar=g), clean.input_ids, clean, emb, loss_mask=lm)
    assert res.report.generated == ((1, tuple(at)),)
    assert torch.equal(res.embeddings, ref.embeddings)
    # a loss that trains on every placeholder tells media from generated apart nowhere
    with pytest.raises(MediaAlignmentError):
        merge(guard("raise", grammar=g), bad, clean, emb, loss_mask=torch.ones_like(lm))


@pytest.mark.parametrize("generated", ["text", "drop"])
def test_first_and_last_stage_reach_the_same_plan(generated):
    clean, bad, labels, lm, _ = rollout()
    first, last = stages(Q, "raise", generated=generated)
    res = merge(first, bad, clean, torch.randn(*bad.shape, H), labels=labels, loss_mask=lm)
    assert_same(res, last.last_stage(bad, clean.items, labels=labels, loss_mask=lm))


def test_packed_rows_name_the_packed_sample():
    a = build_batch(Q, [[("image", 3)]], text=RESPONSE)
    b = build_batch(Q, [[("image", 2)]], text=RESPONSE, seed=1)
    ids = torch.cat([a.input_ids, b.input_ids], 1)
    cu = torch.tensor([0, a.input_ids.shape[1], ids.shape[1]])
    n = ids.shape[1]
    bad = ids.clone()
    bad[0, n - 2] = 5
    labels = torch.full_like(ids, -100)
    labels[0, n - RESPONSE :] = ids[0, n - RESPONSE :]
    items = [*a.items, *[it.__class__(it.num_features, sample=1) for it in b.items]]
    emb = torch.randn(1, n, H)
    feats = torch.randn(5, H)
    res = guard("raise").merge(emb, bad, feats, items, labels=labels, cu_seqlens=cu)
    ref = guard("raise").merge(emb, ids, feats, items, labels=labels, cu_seqlens=cu)
    assert res.report.generated == ((1, (n - 2,)),)
    assert torch.equal(res.embeddings, ref.embeddings)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    name=st.sampled_from(["qwen", "internvl", "pixtral", "plain"]),
    n=st.integers(1, 2),
    generated=st.sampled_from(["text", "drop"]),
)
def test_property_generated_placeholders_never_change_another_sample(seed, name, n, generated):
    g = TEST_GRAMMARS[name]
    rng = random.Random(seed)
    layout = random_layout(
        rng, batch=rng.randint(2, 4), max_items=2, max_len=5, modalities=tuple(g.placeholders)
    )
    k = rng.randrange(len(layout))
    clean, bad, _labels, lm, _at = rollout(g, layout, sample=k, n=n, seed=seed)
    emb = torch.randn(*bad.shape, H)
    cfg = GuardConfig(policy="drop", generated=generated)
    res = MediaGuard(cfg, g).merge(emb, bad, clean.features(H), clean.items, loss_mask=lm)
    ref = MediaGuard(cfg, g).merge(
        emb, clean.input_ids, clean.features(H), clean.items, loss_mask=lm
    )
    assert ref.report.actions == ("keep",) * len(layout)
    for smp in range(len(layout)):
        if smp != k:
            assert torch.equal(res.embeddings[smp], ref.embeddings[smp]), smp
            assert torch.equal(res.loss_mask[smp], lm[smp])
    # without markers and without media anywhere the loss tells nothing apart
    told = any(layout) or (g.start_id is not None and g.end_id is not None)
    if generated == "text" and told:
        assert torch.equal(res.embeddings, ref.embeddings) and res.report.dropped == ()
    else:
        assert res.report.dropped == (k,)
