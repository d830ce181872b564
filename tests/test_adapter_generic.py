"""Guarding a custom model's own merge method (Megatron-Bridge style)."""

from __future__ import annotations

import pytest
import torch

from megatron_media_guard import (
    Grammar,
    GuardConfig,
    MediaAlignmentError,
    MediaGuard,
    MediaInputError,
    MediaItem,
)
from megatron_media_guard.adapters import (
    ArgMap,
    guard_merge_fn,
    guarded_by,
    infer_items,
    install_generic,
)
from megatron_media_guard.adapters.hooks import GuardHandle
from megatron_media_guard.core.runs import parse_runs

START, END, PAD = 3, 4, 5
GRAMMAR = Grammar({"image": PAD}, start_id=START, end_id=END)
H = 8


class TinyVLM(torch.nn.Module):
    """A custom VLM whose merge is the usual unchecked masked_scatter."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(H, H)

    def merge_embeddings(self, inputs_embeds, input_ids, image_features):
        mask = (input_ids == PAD).unsqueeze(-1)
        return inputs_embeds.masked_scatter(mask, image_features)

    def forward(self, inputs_embeds, input_ids, pixels):
        return self.merge_embeddings(inputs_embeds, input_ids, self.proj(pixels))


def batch(runs_per_sample, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (len(runs_per_sample), s), generator=g)
    items = []
    for b, runs in enumerate(runs_per_sample):
        p = 1
        for n in runs:
            ids[b, p] = START
            ids[b, p + 1 : p + 1 + n] = PAD
            ids[b, p + 1 + n] = END
            items.append(MediaItem(n, sample=b))
            p += n + 3
    emb = torch.randn(len(runs_per_sample), s, H, generator=g)
    total = sum(it.num_features for it in items)
    return emb, ids, torch.randn(total, H, generator=g), items


def guard(policy="raise", **kw):
    return MediaGuard(GuardConfig(policy=policy, **kw), GRAMMAR)


def test_aligned_merge_is_bit_identical_and_reversible():
    model = TinyVLM()
    emb, ids, _, items = batch([[3, 2], [4], []])
    pixels = torch.randn(sum(it.num_features for it in items), H)
    ref = model(emb, ids, pixels)
    handle = install_generic(model, "merge_embeddings", guard("drop"))
    assert guarded_by(model.merge_embeddings) is handle
    assert model.merge_embeddings.__wrapped__ == TinyVLM.merge_embeddings.__get__(model)
    handle.set_items(items)
    assert torch.equal(model(emb, ids, pixels), ref)
    assert handle.last_result.report.ok
    handle.remove()
    assert "merge_embeddings" not in vars(model)
    assert torch.equal(model(emb, ids, pixels), ref)


def test_offsetting_error_raises_or_drops_per_sample():
    emb, ids, feats, _items = batch([[3], [4], [2]])
    # +1 / -1: the totals agree and the plain merge silently shifts a row across samples
    bad = [MediaItem(4, sample=0), MediaItem(3, sample=1), MediaItem(2, sample=2)]
    ref = TinyVLM().merge_embeddings(emb, ids, feats)
    model = TinyVLM()
    install_generic(model, "merge_embeddings", guard("raise")).set_items(bad)
    with pytest.raises(MediaAlignmentError, match="sample 0"):
        model.merge_embeddings(emb, ids, feats)
    model = TinyVLM()
    handle = install_generic(model, "merge_embeddings", guard("drop"))
    handle.set_items(bad)
    out = model.merge_embeddings(emb, ids, feats)
    assert handle.last_result.report.dropped == (0, 1)
    assert torch.equal(out[2], ref[2])
    lm, _ = handle.mask_loss(torch.ones(3, 16))
    assert lm.sum(1).tolist() == [0.0, 0.0, 16.0]


def test_items_from_a_parameter_and_seq_first_output():
    def merge(x, ids, feats, items):
        raise AssertionError("the guard replaces the merge")

    emb, ids, feats, items = batch([[2], [3]])
    amap = ArgMap(embeddings="x", input_ids="ids", features="feats", items="items", seq_first=True)
    fn = guard_merge_fn(merge, guard(), arg_map=amap)
    out = fn(emb.transpose(0, 1), ids, feats, items)
    ref = emb.masked_scatter((ids == PAD).unsqueeze(-1), feats)
    assert out.shape == (16, 2, H) and torch.equal(out, ref.transpose(0, 1))
    assert fn.__wrapped__ is merge and fn.handle.last_result.report.ok


def test_items_without_metadata_from_a_feature_list_or_the_runs():
    emb, ids, feats, _ = batch([[2, 1], [3]])
    ref = TinyVLM().merge_embeddings(emb, ids, feats)
    fn = guard_merge_fn(TinyVLM().merge_embeddings, guard())
    assert torch.equal(fn(emb, ids, [feats[:2], feats[2:3], feats[3:]]), ref)  # one per tensor
    assert torch.equal(fn(emb, ids, feats), ref)  # totals agree: one item per run
    assert fn.handle.last_result.report.num_items == 3
    with pytest.raises(MediaAlignmentError, match="7 feature rows for 6 placeholders"):
        fn(emb, ids, torch.cat([feats, feats[:1]]))


def test_structural_finding_is_caught_without_metadata():
    emb, ids, feats, _ = batch([[2], [3]])
    ids[1, 10] = PAD  # a literal placeholder typed in text, outside any region
    fn = guard_merge_fn(TinyVLM().merge_embeddings, guard("drop"))
    fn(emb, ids, torch.cat([feats, feats[:1]]))
    assert fn.handle.last_result.report.dropped == (1,)


def test_infer_items_per_modality():
    g = Grammar({"image": 7, "audio": 8})
    ids = torch.tensor([[1, 7, 7, 2, 8, 8, 8], [7, 1, 2, 3, 4, 5, 6]])
    parsed = parse_runs(ids, g)
    items, bad = infer_items(parsed, {"image": 3, "audio": 3})
    assert bad == () and [(i.num_features, i.sample, i.modality) for i in items] == [
        (2, 0, "image"),
        (3, 0, "audio"),
        (1, 1, "image"),
    ]
    items, bad = infer_items(parsed, {"image": 4, "audio": 3})
    assert bad == ("image",) and [i.modality for i in items] == ["audio"]


def test_missing_parameter_is_a_clear_error():
    with pytest.raises(MediaInputError, match="no parameter 'image_features'"):
        guard_merge_fn(lambda inputs_embeds, input_ids, feats: inputs_embeds, guard())


def packed_batch():
    """Three samples packed in one row [1, 20] (cu_seqlens), 2 padding tokens at the end."""
    samples = [
        [11, START, PAD, PAD, END, 12],
        [13, START, PAD, PAD, PAD, END, 14],
        [15, 16, START, PAD, END],
    ]
    flat = [t for smp in samples for t in smp] + [0, 0]
    cu = torch.tensor([0, 6, 13, 18])
    ids = torch.tensor([flat])
    emb = torch.randn(1, len(flat), H)
    return emb, ids, cu


@pytest.mark.parametrize(
    "declared, dropped", [((2, 2, 1), (1,)), ((1, 3, 1), (0,)), ((2, 3, 2), (2,))]
)
def test_mask_loss_masks_packed_samples_token_by_token(declared, dropped):
    emb, ids, cu = packed_batch()
    items = [MediaItem(n, sample=i) for i, n in enumerate(declared)]
    feats = torch.randn(sum(declared), H)
    amap = ArgMap(cu_seqlens="cu_seqlens")

    def merge(inputs_embeds, input_ids, image_features, cu_seqlens):
        raise AssertionError("replaced by the guard")

    fn = guard_merge_fn(merge, guard("drop"), arg_map=amap)
    fn.handle.set_items(items)
    fn(emb, ids, feats, cu)
    assert fn.handle.last_result.report.dropped == dropped
    lm = torch.ones(1, 20)
    labels = torch.arange(20).view(1, 20)
    lm2, labels2 = fn.handle.mask_loss(lm, labels)
    want = torch.ones(20, dtype=torch.bool)  # kept tokens (padding stays as given)
    for d in dropped:
        want[int(cu[d]) : int(cu[d + 1])] = False
    assert torch.equal(lm2[0] == 1, want)
    assert torch.equal(labels2[0], torch.where(want, labels[0], -100))
    assert torch.equal(lm, torch.ones(1, 20))  # the caller's tensors are untouched
    # the same mask as the merge's own per-token result
    assert torch.equal(lm2, fn.handle.last_result.loss_mask)
    none, only_labels = fn.handle.mask_loss(None, labels)
    assert none is None and torch.equal(only_labels, labels2)
    with pytest.raises(MediaInputError, match=r"loss_mask must be \[b, s\] = \(1, 20\)"):
        fn.handle.mask_loss(torch.ones(3, 20))


def test_unassignable_features_stay_in_the_graph():
    emb, ids, feats, _ = batch([[2], [3]])
    feats = torch.cat([feats, feats[:1]]).requires_grad_(True)  # 6 rows, 5 placeholders
    fn = guard_merge_fn(TinyVLM().merge_embeddings, guard("drop"))
    out = fn(emb, ids, feats)
    assert fn.handle.last_result.report.dropped == (0, 1)
    assert torch.equal(out, emb)  # nothing merged, and -0.0 added changes no bit
    out.sum().backward()
    assert feats.grad is not None and (feats.grad == 0).all()


def _end(h):
    h.guard.on_step_end(0)


@pytest.mark.parametrize(
    "ops, want",
    [
        # no step and no step end: the handle cannot tell micro-batches from steps, names none
        (["call", "call"], [(None, None), (None, None)]),
        # step ends (the training loop, the optimizer hook) without a step: counted from 0
        (
            ["call", _end, "call", "call", _end, "call"],
            [(None, None), (None, 0), (None, 1), (None, 0)],
        ),
        # set_step: from 0 in each step
        ([5, "call", "call", 6, "call"], [(5, 0), (5, 1), (6, 0)]),
        # the same step set again is the same step; a step end starts the next from 0
        ([5, "call", 5, "call", _end, "call"], [(5, 0), (5, 1), (5, 0)]),
        # set_step's own microbatch wins
        [[(3, 2), "call", "call"], [(3, 2), (3, 2)]],
    ],
)
def test_microbatches_are_counted_per_step_from_zero(ops, want):
    guard = MediaGuard(GuardConfig(), GRAMMAR, consensus=False)
    h = GuardHandle(TinyVLM(), "merge_embeddings", guard, "generic", auto_step_end=False)
    got = []
    for op in ops:
        if op == "call":
            got.append(h.next_call())
        elif callable(op):
            op(h)
        else:
            h.set_step(*(op if isinstance(op, tuple) else (op,)))
    assert got == want
