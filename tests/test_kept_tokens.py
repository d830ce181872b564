"""The count a per-token loss needs after drops (docs/CONSENSUS.md, "Drops and loss
normalization"): ``handle.mask_loss(..., return_count=True)`` and ``kept_tokens``."""

from __future__ import annotations

import pytest
import torch
from test_adapter_generic import TinyVLM, batch, guard

from megatron_media_guard import MediaInputError, MediaItem
from megatron_media_guard.adapters import install_generic
from megatron_media_guard.core.apply import kept_tokens


@pytest.mark.parametrize("given", ["loss_mask", "labels", "both"])  # both: the loss mask counts
def test_mask_loss_returns_the_kept_token_count(given):
    emb, ids, feats, _ = batch([[3], [4], [2]])
    model = TinyVLM()
    handle = install_generic(model, "merge_embeddings", guard("drop"))
    handle.set_items([MediaItem(4, sample=0), MediaItem(3, sample=1), MediaItem(2, sample=2)])
    model.merge_embeddings(emb, ids, feats)
    assert handle.last_result.report.dropped == (0, 1)
    lm = torch.ones(3, 16) if given in ("loss_mask", "both") else None
    labels = torch.zeros(3, 16, dtype=torch.long) if given in ("labels", "both") else None
    out_lm, out_labels, kept = handle.mask_loss(lm, labels, return_count=True)
    assert kept.dim() == 0 and kept.item() == 16  # only sample 2's 16 tokens stay
    plain = handle.mask_loss(lm, labels)  # without return_count: the same two tensors
    assert len(plain) == 2
    for a, b in zip(plain, (out_lm, out_labels)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_kept_tokens_counts_a_mask_or_labels():
    lm = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    labels = torch.tensor([[1, -100, 2], [-100, -100, -100]])
    assert kept_tokens(lm).item() == 2
    assert kept_tokens(None, labels).item() == 2
    assert kept_tokens(None, labels, ignore_index=1).item() == 5
    with pytest.raises(MediaInputError, match="loss_mask or labels"):
        kept_tokens(None, None)
