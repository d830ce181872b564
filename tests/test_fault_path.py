"""The drop path costs the output and little else: no gathered copy of the features, an O(1)
anchor, the same bits as a merge of the kept samples alone, and the tower stays in the graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaGuard, MediaItem
from megatron_media_guard.core.apply import scatter_kept, token_keep, zero_anchor
from megatron_media_guard.core.items import normalize
from megatron_media_guard.core.runs import TokenLayout
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch

Q = TEST_GRAMMARS["qwen"]


class Allocations(TorchDispatchMode):
    """Records every storage an op creates (views and in-place results are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, int] = {}  # data_ptr -> numel of the storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                ptr = t.untyped_storage().data_ptr()
                self.seen[ptr] = max(self.seen.get(ptr, 0), t.untyped_storage().nbytes())
        return out

    def larger_than(self, nbytes: int) -> list[int]:
        return sorted(n for n in self.seen.values() if n > nbytes)


def _offsetting(layout, bad):
    """Shift one feature between the first two items of each bad sample: same totals, same
    tokens, the sample mismatched."""
    batch = build_batch(Q, layout, text=2)
    items = list(batch.items)
    first = 0
    for smp, media in enumerate(layout):
        if smp in bad:
            a, b = items[first], items[first + 1]
            items[first] = MediaItem(a.num_features + 1, sample=smp, modality=a.modality)
            items[first + 1] = MediaItem(b.num_features - 1, sample=smp, modality=b.modality)
        first += len(media)
    return batch.input_ids, items


@pytest.mark.parametrize("bad", [(1,), (0, 1, 2, 3)], ids=["one of 4", "all 4"])
def test_drop_allocates_the_output_and_token_sized_indices_only(bad):
    layout = [[("image", 30)] * 4 for _ in range(4)]
    ids, items = _offsetting(layout, set(bad))
    b, s = ids.shape
    h = 64
    emb = torch.randn(b, s, h)
    feats = torch.randn(sum(it.num_features for it in items), h)
    g = MediaGuard(GuardConfig(policy="drop"), grammar=Q)
    g.merge(emb, ids, feats, items)  # warm-up (lazy imports)
    with Allocations() as seen:
        res = g.merge(emb, ids, feats, items)
    assert res.report.dropped == bad
    # the output is the one allocation above the token count (int64 per token of the
    # edge-padded rows, s + 2 each); a gathered copy of the kept features, or an
    # elementwise anchor, would show here
    assert seen.larger_than(8 * b * (s + 2)) == [emb.numel() * emb.element_size()]


@pytest.mark.parametrize(
    "policy, bad, dropped",
    [
        ("drop", (), ()),
        ("drop", (1,), (0, 1, 2, 3)),
        ("repair", (1,), (0, 1, 2, 3)),
        ("raise", (1,), None),  # raises naming the first sample
    ],
)
def test_fault_checks_run_on_the_fault_path_only_and_apply_the_policy(policy, bad, dropped):
    """``merge(fault_checks=)``: not run on an aligned call; a finding there gives every
    sample the policy (``fallback`` under repair), its reason in the plan, counted."""
    ids, items = _offsetting([[("image", 4)] * 2 for _ in range(4)], set(bad))
    calls = []

    def checks():
        calls.append(1)
        return ["text: 3 text tokens, 2 text rows"]

    g = MediaGuard(GuardConfig(policy=policy, fallback="drop"), grammar=Q)
    emb = torch.randn(*ids.shape, 8)
    feats = torch.randn(sum(it.num_features for it in items), 8)
    kw = dict(loss_mask=torch.ones(ids.shape), fault_checks=checks)
    if dropped is None:
        with pytest.raises(MediaAlignmentError, match=r"sample 0(.|\n)*text: 3 text tokens"):
            g.merge(emb, ids, feats, items, **kw)
        return
    res = g.merge(emb, ids, feats, items, **kw)
    assert res.report.dropped == dropped and len(calls) == bool(bad)
    assert g.counters["dropped"] == len(dropped) and g.counters["repaired"] == 0
    if dropped:
        assert (res.loss_mask == 0).all() and torch.equal(res.embeddings, emb)


def test_zero_anchor_is_minus_zero_with_no_temporaries_even_on_nan():
    t = torch.tensor([[float("nan"), float("inf")], [-float("inf"), 1.0]], requires_grad=True)
    u = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    with Allocations() as seen:
        a = zero_anchor(t, u, torch.tensor(2.0))
    assert a.item() == 0.0 and torch.signbit(a).item()  # -0.0
    assert seen.larger_than(a.element_size()) == []  # O(1): empty slices, no NaN masking
    a.backward()
    assert torch.equal(t.grad, torch.zeros_like(t)) and torch.equal(u.grad, torch.zeros_like(u))
    with pytest.raises(ValueError):
        zero_anchor()


@pytest.mark.parametrize("corner", [0.0, -0.0, float("nan")])
def test_all_dropped_with_nonfinite_features_keeps_every_bit_and_the_graph(corner):
    layout = [[("image", 4), ("image", 3)], [("image", 5), ("image", 2)]]
    ids, items = _offsetting(layout, {0, 1})
    tower = torch.nn.Linear(5, 8)
    feats = tower(torch.randn(sum(it.num_features for it in items), 5))
    feats = torch.cat([feats[:3], torch.full_like(feats[3:4], float("nan")), feats[4:]])
    emb = torch.randn(*ids.shape, 8)
    emb[0, 0, 0] = corner  # the element the anchor is added to
    cfg = GuardConfig(policy="drop", nonfinite="drop")
    res = MediaGuard(cfg, grammar=Q).merge(emb, ids, feats, items)
    assert res.report.dropped == (0, 1)
    out = res.embeddings
    assert torch.equal(out.view(torch.int32), emb.view(torch.int32))  # bits, signed zeros too
    (out.nan_to_num().sum() + res.loss_mask.sum()).backward()
    assert torch.equal(tower.weight.grad, torch.zeros_like(tower.weight))  # None: a TypeError


def _reference(emb, lay, batch, kept, replaced, keep):
    """The previous implementation: a gathered copy of the kept features, masked_scatter."""
    f = batch.features
    pieces = [replaced[i] if i in replaced else f[slice(*batch.rows(i))] for i in kept]
    src = torch.cat(pieces) if pieces else emb.new_zeros(0, emb.shape[-1])
    return emb.masked_scatter((lay.ph & token_keep(lay, keep)).unsqueeze(-1), src)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lens=st.lists(st.lists(st.integers(1, 5), max_size=3), min_size=1, max_size=4),
    keep_bits=st.integers(0, 15),
    order_seed=st.integers(0, 1000),
    repair=st.sampled_from([None, 0, -1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_property_scatter_from_views_matches_the_gathered_copy(
    lens, keep_bits, order_seed, repair, dtype
):
    layout = [[("image", n) for n in row] for row in lens]
    batch0 = build_batch(Q, layout, text=1)
    items = list(batch0.items)
    # the caller's item order need not be token order (explicit samples)
    perm = list(range(len(items)))
    torch.manual_seed(order_seed)
    perm = [perm[i] for i in torch.randperm(len(perm)).tolist()]
    items = [items[i] for i in perm]
    h = 6
    feats = torch.randn(sum(it.num_features for it in items), h).to(dtype)
    lay = TokenLayout(batch0.input_ids, Q)
    batch = normalize(feats, items, lay.num_samples)
    keep = torch.tensor([bool(keep_bits >> k & 1) for k in range(lay.num_samples)])
    kept = [i for i in batch.order if keep[items[i].sample]]
    replaced = {}
    if repair is not None and kept:
        i = kept[repair]
        replaced[i] = torch.randn(items[i].num_features, h).to(dtype)
    emb = torch.randn(*batch0.input_ids.shape, h).to(dtype)
    got = scatter_kept(emb, lay, batch, kept, replaced, keep)
    want = _reference(emb, lay, batch, kept, replaced, keep)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
