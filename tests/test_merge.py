"""The guarded merge: aligned path, raise, drop, bad input, and merge properties."""

from __future__ import annotations

import math
import random
from itertools import accumulate

import pytest
import torch
from devices import DEVICES
from family_checks import records
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_media_guard import (
    Grammar,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.testing import FAULTS, TEST_GRAMMARS, build_batch, inject, random_layout

Q = TEST_GRAMMARS["qwen"]
H = 8
LAYOUT = [[("image", 4), ("image", 6)], [("image", 3)], [("video", 8)], []]


def placeholders(ids, grammar=Q):
    return torch.isin(ids, torch.tensor(list(grammar.placeholders.values())))


def unguarded(emb, ids, feats, grammar=Q):
    """Today's merge: placeholder mask + masked_scatter."""
    return emb.masked_scatter(placeholders(ids, grammar).unsqueeze(-1), feats)


def item_rows(batch, feats, own):
    """The feature rows of the items ``own``, concatenated."""
    ends = list(accumulate(it.num_features for it in batch.items))
    return torch.cat(
        [feats[ends[i] - batch.items[i].num_features : ends[i]] for i in own] or [feats[:0]]
    )


def guard(policy="raise", **kw):
    return MediaGuard(GuardConfig(policy=policy, **kw), grammar=Q, rank=RankInfo(rank=3))


def inputs(batch, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s = batch.input_ids.shape
    emb = torch.randn(b, s, H, generator=g).to(dtype)
    return emb, batch.features(H, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grammar", ["qwen", "internvl", "pixtral", "plain"])
def test_aligned_merge_is_bit_identical_with_one_transfer(dtype, grammar):
    g = TEST_GRAMMARS[grammar]
    layout = [[(m if m in g.placeholders else "image", n) for m, n in s] for s in LAYOUT]
    batch = build_batch(g, layout)
    emb, feats = inputs(batch, dtype)
    with count_transfers() as seen:
        res = MediaGuard(GuardConfig(), grammar=g).merge(emb, batch.input_ids, feats, batch.items)
    assert sum(seen.values()) == 1, seen
    assert torch.equal(res.embeddings, unguarded(emb, batch.input_ids, feats, g))
    assert res.report.ok and res.report.alignment is None
    assert res.loss_mask is None and res.labels is None


@pytest.mark.parametrize("form", ["masks", "feature list, items inferred", "seq_first", "packed"])
def test_aligned_call_forms_merge_as_unguarded(form):  # dropped packed: test_plan_determinism
    batch = build_batch(Q, [[("image", 4), ("image", 6)], [("image", 3)], []])  # images only
    ids, items = batch.input_ids, batch.items
    emb, feats = inputs(batch)
    kw, args = {}, (emb, ids, feats, items)
    if form == "masks":  # the caller's own tensors come back untouched
        kw = {"loss_mask": torch.ones(ids.shape), "labels": ids.clone()}
    elif form == "seq_first":
        kw, args = {"seq_first": True}, (emb.transpose(0, 1).contiguous(), *args[1:])
    elif form == "packed":  # the rows one after the other, a packed sample each
        cu = torch.arange(0, ids.numel() + 1, ids.shape[1])
        ids, emb = ids.reshape(1, -1), emb.reshape(1, -1, H)
        kw, args = {"cu_seqlens": cu}, (emb, ids, feats, items)
    else:
        args = (emb, ids, list(feats.split([it.num_features for it in items])))
    res = guard().merge(*args, **kw)
    out = res.embeddings
    if form == "seq_first":  # [s, b, h] back, as given
        assert out.shape == (ids.shape[1], ids.shape[0], H)
        out = out.transpose(0, 1)
    assert torch.equal(out, unguarded(emb, ids, feats))
    assert res.loss_mask is kw.get("loss_mask") and res.labels is kw.get("labels")


def test_raise_names_everything(tmp_path):
    batch = inject(Q, LAYOUT, "budget_shrink")
    emb, feats = inputs(batch)
    g = MediaGuard(GuardConfig(log_dir=str(tmp_path)), grammar=Q, rank=RankInfo(rank=3))
    with pytest.raises(MediaAlignmentError) as info:
        g.merge(emb, batch.input_ids, feats, batch.items, step=12, microbatch=1)
    msg = str(info.value)
    for needle in [
        "rank 3",
        "step 12",
        "microbatch 1",
        "sample 0",
        "'s0'",
        "item 0",
        "image",
        "[4, 6]",
        "[5, 7]",
        "first mismatch at run 0",
        "surplus",
        "56x84 (HxW)",
    ]:
        assert needle in msg, (needle, msg)
    # the record was on disk before the raise
    recs = records(tmp_path)
    assert [r["event"] for r in recs] == ["raise"]
    first = recs[0]
    assert (first["rank"], first["step"], first["sample"], first["sample_id"]) == (3, 12, 0, "s0")
    assert (first["expected"], first["got"], first["first_mismatch"]) == ([4, 6], [5, 7], 0)


def test_video_item_error_names_frames():
    batch = inject(Q, [[("video", 8)]], "video_grid")
    emb, feats = inputs(batch)
    with pytest.raises(MediaAlignmentError, match="4 frames"):
        guard().merge(emb, batch.input_ids, feats, batch.items)


@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "none"])
def test_drop_keeps_others_identical_and_masks_the_culprit(fault):
    batch = inject(Q, LAYOUT, fault)
    emb, feats = inputs(batch)
    b, s = batch.input_ids.shape
    lm, lab = torch.ones(b, s), torch.randint(0, 50, (b, s))
    # placeholders are not trained on (under the loss outside a region: generated, kept as
    # text: test_generated.py)
    lm[placeholders(batch.input_ids)] = 0
    res = guard("drop").merge(emb, batch.input_ids, feats, batch.items, loss_mask=lm, labels=lab)
    dropped = set(res.report.dropped)
    assert dropped == set(batch.faulty_samples)
    for smp in range(b):
        if smp in dropped:
            assert res.loss_mask[smp].eq(0).all() and res.labels[smp].eq(-100).all()
            # no foreign feature: every position still holds its text embedding
            assert torch.equal(res.embeddings[smp], emb[smp])
        else:
            # what an unguarded merge of this sample alone gives, bit for bit
            own = [i for i, it in enumerate(batch.items) if it.sample == smp]
            rows = item_rows(batch, feats, own)
            want = unguarded(emb[smp : smp + 1], batch.input_ids[smp : smp + 1], rows)[0]
            assert torch.equal(res.embeddings[smp], want)
            assert torch.equal(res.loss_mask[smp], lm[smp])
            assert torch.equal(res.labels[smp], lab[smp])


def test_drop_creates_a_loss_mask_when_none_given():
    batch = inject(Q, LAYOUT, "extra_pad")
    emb, feats = inputs(batch)
    res = guard("drop").merge(emb, batch.input_ids, feats, batch.items)
    assert res.loss_mask.dtype == torch.float32
    assert res.loss_mask.sum(1).tolist() == [0.0] + [float(batch.input_ids.shape[1])] * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "both infs"])
def test_nonfinite_found_in_every_float_dtype(dtype, bad):
    batch = build_batch(Q, LAYOUT)
    emb, feats = (t.to(dtype) for t in inputs(batch))
    if bad == "both infs":  # +inf and -inf: their sum is NaN, still found
        feats[10, 2], feats[11, 3] = math.inf, -math.inf
    else:
        feats[10, 2] = bad  # item 2 = sample 1
    args = (emb, batch.input_ids, feats, batch.items)
    res = guard(nonfinite="drop").merge(*args)
    assert res.report.dropped == (1,) and torch.isfinite(res.embeddings).all()
    with pytest.raises(MediaAlignmentError, match="sample 1"):
        guard(nonfinite="raise").merge(*args)
    assert guard(nonfinite="off").merge(*args).report.ok  # the check skipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_huge_finite_features_are_no_nonfinite_alarm(dtype):
    """Features whose sum overflows the dtype are finite: kept, bit for bit."""
    batch = build_batch(Q, LAYOUT)
    emb, feats = (t.to(dtype) for t in inputs(batch))
    feats.fill_(torch.finfo(dtype).max)
    res = guard(nonfinite="raise").merge(emb, batch.input_ids, feats, batch.items)
    assert res.report.ok and res.report.dropped == ()
    assert torch.equal(res.embeddings, unguarded(emb, batch.input_ids, feats))


BATCH = build_batch(Q, [[("image", 2)]])
N = BATCH.input_ids.shape[1]
EMB = torch.zeros(1, N, H)
FEATS = torch.zeros(2, H)
F8 = torch.float8_e4m3fn
CU_BAD = "cu_seqlens must start at 0, never decrease"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embeddings": EMB.long()}, "floating-point"),
        ({"embeddings": EMB[0]}, r"\[b, s, h\]"),
        ({"embeddings": EMB[:, :-1]}, "do not match input_ids"),
        ({"features": FEATS.double()}, "cast the projector output"),
        ({"features": torch.zeros(2, H + 1)}, "hidden size"),
        ({"features": torch.zeros(3, H)}, "declare 2 feature rows"),
        ({"features": torch.zeros(2, H, 1)}, r"\[sum\(num_features\), hidden\]"),
        ({"input_ids": BATCH.input_ids.float()}, "integer token ids"),
        ({"input_ids": BATCH.input_ids[:, :0], "embeddings": EMB[:, :0]}, "empty batch"),
        ({"items": [MediaItem(2, sample=4)]}, "names sample 4"),
        ({"items": [MediaItem(1, 0), MediaItem(1)]}, "every item or for none"),
        ({"loss_mask": torch.ones(2, 2)}, "loss_mask must be"),
        ({"labels": torch.ones(BATCH.input_ids.shape)}, "labels must be integer"),
        ({"features": [torch.zeros(3, H)]}, "declares 2 features"),
        ({"items": [2]}, "items must be MediaItem, got int"),  # with packed features too
        ({"embeddings": EMB.to(F8), "features": FEATS.to(F8)}, "merge in bf16"),
        ({"cu_seqlens": torch.tensor([0, N, 1, N])}, CU_BAD),  # decreasing
        ({"cu_seqlens": torch.tensor([0, N + 4])}, CU_BAD),  # past the row's end
        ({"cu_seqlens": torch.tensor([2, N])}, CU_BAD),  # not at 0
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    args = dict(embeddings=EMB, input_ids=BATCH.input_ids, features=FEATS, items=BATCH.items)
    with pytest.raises(MediaInputError, match=match) as info:
        guard().merge(**(args | kwargs))
    assert "rank 3" in str(info.value)
    # a wrong call: a trainer's ``except MediaAlignmentError`` around a step does not swallow it
    assert not isinstance(info.value, MediaAlignmentError)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    fault=st.sampled_from(FAULTS),
    name=st.sampled_from(["qwen", "internvl", "pixtral"]),
    explicit=st.booleans(),
    policy=st.sampled_from(["raise", "drop"]),
)
def test_property_only_library_errors_and_kept_features_are_own(
    seed, fault, name, explicit, policy
):
    g = TEST_GRAMMARS[name]
    rng = random.Random(seed)
    layout = random_layout(
        rng, batch=rng.randint(2, 4), max_items=3, max_len=7, modalities=tuple(g.placeholders)
    )
    try:
        batch = inject(g, layout, fault, seed=seed, explicit_samples=explicit)
    except ValueError:  # the fault does not fit this layout
        return
    b, s = batch.input_ids.shape
    emb = torch.randn(b, s, H)
    feats = batch.features(H)
    total = feats.shape[0]
    feats[:, 1] = torch.arange(total, dtype=feats.dtype)  # global row, to check order
    phs = placeholders(batch.input_ids, g)
    try:  # placeholders not under the loss (generated ones: test_generated.py)
        res = MediaGuard(GuardConfig(policy=policy), grammar=g).merge(
            emb, batch.input_ids, feats, batch.items, loss_mask=(~phs).float()
        )
    except MediaAlignmentError:
        assert policy == "raise" and fault != "none"
        return
    # with sample labels the guard drops exactly the samples the fault touched; without
    # them it may drop a neighbour it cannot clear, never keep a sample with a wrong feature
    dropped = set(res.report.dropped)
    if explicit:
        assert dropped == set(batch.faulty_samples)
    # every kept placeholder holds exactly its own item's feature, in order; the owner comes
    # from the layout the batch was built from, not from the guard (a kept sample whose
    # last run was cut away entirely holds its remaining whole items)
    first = 0
    for smp, media in enumerate(layout):
        own = range(first, first + len(media))
        first += len(media)
        if smp in dropped:
            assert torch.equal(res.embeddings[smp], emb[smp])
            continue
        n = int(phs[smp].sum())
        whole = [0, *accumulate(batch.items[i].num_features for i in own)]
        assert n in whole, (smp, n, whole)
        rows = item_rows(batch, feats, own)
        assert torch.equal(res.embeddings[smp][phs[smp]], rows[:n])
        assert torch.equal(res.embeddings[smp][~phs[smp]], emb[smp][~phs[smp]])


@pytest.mark.parametrize("packed", [False, True])
def test_items_naming_the_wrong_sample_are_caught_when_lengths_line_up(packed):
    batch = build_batch(Q, [[("image", 3)], [("image", 3)]])
    ids = batch.input_ids
    cu = None
    if packed:
        cu = torch.tensor([0, ids.shape[1], 2 * ids.shape[1]])
        ids = ids.reshape(1, -1)
    items = [MediaItem(3, 0), MediaItem(3, 0)]  # both claim sample 0
    emb = torch.randn(*ids.shape, H)
    with pytest.raises(MediaAlignmentError, match="count_mismatch"):
        guard().merge(emb, ids, torch.randn(6, H), items, cu_seqlens=cu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", [[], torch.zeros(0, H)])
@pytest.mark.parametrize("stray", [False, True])
def test_text_only_batch_in_half_precision(dtype, features, stray):
    ids = torch.full((2, 6), 1000)
    if stray:  # a literal placeholder, no media at all, in the prompt (not trained): dropped
        ids[1, 2] = 5
    emb = torch.randn(2, 6, H).to(dtype)
    items = [] if isinstance(features, torch.Tensor) else None
    with count_transfers() as seen:
        res = guard("drop").merge(emb, ids, features, items, loss_mask=(ids != 5).float())
    assert torch.equal(res.embeddings, emb) and res.report.dropped == ((1,) if stray else ())
    assert res.report.ok == (not stray)
    if not stray:  # the aligned path: one transfer
        assert sum(seen.values()) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grammar", ["pixtral", "qwen"])
def test_aligned_path_has_no_hidden_sync(monkeypatch, device, grammar):
    """nonzero sizes its output with a host sync on an accelerator: the aligned path calls
    it only on CPU (where nothing syncs), exactly at the scatter's positions and the run
    starts and ends of ``core/verify_lut.py`` (marker grammars) or the run ends of the
    one modality's table (``core/verify.py``)."""
    g = TEST_GRAMMARS[grammar]
    batch = build_batch(g, [[("image", 6)], [("image", 9)]])
    emb, feats = (t.to(device) for t in inputs(batch))
    ids = batch.input_ids.to(device)
    real, seen = torch.nonzero, []

    def recording_nonzero(t, *a, **k):
        seen.append(t.device.type)
        if t.device.type != "cpu":
            raise AssertionError(f"torch.nonzero on the aligned path on {t.device}")
        return real(t, *a, **k)

    monkeypatch.setattr(torch, "nonzero", recording_nonzero)
    res = MediaGuard(GuardConfig(), grammar=g).merge(emb, ids, feats, batch.items)
    assert res.report.ok
    expected = {"cpu": 1 + (2 if grammar == "qwen" else 1)}.get(device, 0)
    assert seen == ["cpu"] * expected


def test_placeholder_in_packed_padding_is_logged_and_never_merged(tmp_path):
    a = build_batch(Q, [[("image", 3)]])
    n = a.input_ids.shape[1]
    ids = torch.cat([a.input_ids, torch.tensor([[3, 5, 4]])], dim=1)  # a region after cu[-1]
    emb, cu = torch.randn(1, n + 3, H), torch.tensor([0, n])
    with MediaGuard(GuardConfig(policy="drop", log_dir=str(tmp_path)), grammar=Q) as g:
        res = g.merge(emb, ids, torch.randn(3, H), [MediaItem(3, 0)], cu_seqlens=cu)
        assert g.log._fd is not None
    assert g.log._fd is None  # the guard closes its log
    assert res.report.actions == ("keep",)
    assert torch.equal(res.embeddings[0, n:], emb[0, n:])
    rec = records(tmp_path)
    assert [(r["event"], r["action"]) for r in rec] == [("check", "ignored")]
    assert "in_padding" in rec[0]["reason"]


def test_grammar_ids_must_fit_the_ids_dtype():
    wide = Grammar({"image": 70000})
    with pytest.raises(MediaInputError, match=r"do not fit input_ids of dtype torch\.int16"):
        MediaGuard(GuardConfig(), grammar=wide).merge(
            torch.zeros(1, 3, 1),
            torch.tensor([[5, 4464, 6]], dtype=torch.int16),
            torch.ones(1, 1),
            [MediaItem(1, 0)],
        )


def test_featureless_items_own_no_run():
    ids = torch.tensor([[1000, 3, 4, 1000, 3, 5, 5, 4]])  # an empty region, then a 2-run
    items = [MediaItem(0, 0), MediaItem(2, 0)]
    emb = torch.randn(1, 8, H)
    feats = torch.randn(2, H)
    with count_transfers() as seen:
        res = guard().merge(emb, ids, feats, items)
    assert res.report.ok and sum(seen.values()) == 1
    assert torch.equal(res.embeddings, unguarded(emb, ids, feats))
