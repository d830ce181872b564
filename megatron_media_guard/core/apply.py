"""Carrying out a plan on tensors (``plan.py`` decides): scatter kept items, mask dropped samples."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import MediaAlignmentError, MediaInputError
from .host import to_host
from .items import Batch
from .runs import TokenLayout


def rows_index(batch: Batch, item_order: Sequence[int], device: torch.device) -> torch.Tensor:
    """Feature rows of the given items, concatenated in that order. ``[sum n]`` int64."""
    parts = [torch.arange(*batch.rows(i)) for i in item_order]
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return idx.to(device, non_blocking=True)


def scatter(
    emb: torch.Tensor, mask: torch.Tensor, src: torch.Tensor, *, inplace: bool = False
) -> torch.Tensor:
    """``emb.masked_scatter(mask[..., None], src)`` for ``emb`` ``[b, s, h]``, ``mask`` ``[b, s]``
    with exactly ``src.shape[0]`` Trues. On CPU an ``index_put`` at ``nonzero`` positions (no
    sync there) writes the same bits a third faster; elsewhere ``masked_scatter``. ``inplace``:
    into ``emb`` itself (the caller's own copy from an earlier scatter)."""
    if emb.device.type != "cpu":
        m = mask.unsqueeze(-1)
        return emb.masked_scatter_(m, src) if inplace else emb.masked_scatter(m, src)
    pos = torch.nonzero(mask.reshape(-1)).view(-1)
    if pos.shape[0] != src.shape[0]:
        raise MediaAlignmentError(  # the caller's verdict said otherwise: a bug, not input
            f"scatter: {pos.shape[0]} placeholder positions for {src.shape[0]} feature rows",
            context={"positions": pos.shape[0], "rows": src.shape[0]},
        )
    if emb.is_contiguous():  # one flat index: no row/column split
        flat = emb.view(-1, emb.shape[-1])
        out = flat.index_put_((pos,), src) if inplace else flat.index_put((pos,), src)
        return out.view(emb.shape)
    s = mask.shape[1]
    idx = (pos // s, pos % s)
    return emb.index_put_(idx, src) if inplace else emb.index_put(idx, src)


def nonfinite_items(batch: Batch) -> list[int]:
    """Items whose features hold NaN/Inf (one transfer of one flag per item)."""
    f = batch.features
    views = [f[a:b] for a, b in (batch.rows(i) for i in range(len(batch.items)))]
    bad = nonfinite_flags(views, why="which items hold NaN/Inf")
    return [i for i, b in enumerate(bad) if b]


def nonfinite_flags(views: Sequence[torch.Tensor], *, why: str) -> list[bool]:
    """Whether each of ``views`` (one device) holds NaN/Inf, in one transfer: min and max
    propagate NaN and show +-Inf (no temporary of the views' size)."""
    if not views:
        return []
    lohi = [torch.stack(torch.aminmax(v)) if v.numel() else v.new_zeros(2) for v in views]
    if len({p.dtype for p in lohi}) == 1:
        ok = torch.isfinite(torch.stack(lohi))
    else:  # views of several dtypes (LLaVA's images and clips): tested one by one
        ok = torch.stack([torch.isfinite(p) for p in lohi])
    return [bool(b) for b in to_host(~ok.all(1), why=why).tolist()]


def token_keep(lay: TokenLayout, keep: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: the token belongs to a kept sample (padding of a packed row: False)."""
    return keep[lay.sample.clamp(max=lay.num_samples - 1)] & (lay.sample < lay.num_samples)


def scatter_kept(
    emb: torch.Tensor,
    lay: TokenLayout,
    batch: Batch,
    kept_items: Sequence[int],
    replaced: dict[int, torch.Tensor],
    keep: torch.Tensor,
) -> torch.Tensor:
    """The kept items (token order; repaired ones' new features) scattered into the kept
    samples' placeholders, every other feature anchored at zero weight. emb: ``[b, s, h]``;
    keep: ``[num_samples]`` bool. Items contiguous in the features are written from a view."""
    f = batch.features
    spans: list[tuple[torch.Tensor, int, int]] = []  # (source, first row, end row)
    for i in kept_items:
        src, a, b = (replaced[i], 0, replaced[i].shape[0]) if i in replaced else (f, *batch.rows(i))
        if spans and spans[-1][0] is src and spans[-1][2] == a:
            spans[-1] = (src, spans[-1][1], b)
        elif b > a:
            spans.append((src, a, b))
    total = sum(b - a for _, a, b in spans)
    mask = (lay.ph & token_keep(lay, keep)).reshape(-1)
    if emb.device.type == "cpu":  # sized from the known count: no sync
        pos = torch.nonzero_static(mask, size=total).squeeze(1)
    else:  # off the aligned path a sync is fine (nonzero_static is not in every release)
        pos = torch.nonzero(mask).squeeze(1)
    s = lay.row_length
    rows, cols = pos // s, pos % s  # kept placeholders in token order
    out, k = None, 0
    for src, a, b in spans:
        idx = (rows[k : k + b - a], cols[k : k + b - a])
        part = src if (a, b) == (0, src.shape[0]) else src[a:b]
        out = emb.index_put(idx, part) if out is None else out.index_put_(idx, part)
        k += b - a
    if out is None:
        out = emb.clone()
    unused = (set(range(len(batch.items))) - set(kept_items)) | set(replaced)
    if unused:
        # the vision tower stays in the autograd graph, no bit changes (see zero_anchor)
        out[0, 0, 0] = out[0, 0, 0] + zero_anchor(f).to(out.dtype)
    return out


def zero_anchor(*tensors: torch.Tensor) -> torch.Tensor:
    """A scalar ``-0.0`` in the autograd graph of every one of ``tensors`` (gradient zero):
    added to one output element it keeps the vision tower in the graph without changing a
    bit (-0.0 is every float's additive identity). An empty slice's sum: O(1), NaN-proof."""
    if not tensors:
        raise ValueError("zero_anchor needs at least one tensor")
    total = None
    for t in tensors:
        part = (t.reshape(1) if t.dim() == 0 else t)[:0].sum()
        total = part if total is None else total + part.to(total.dtype)
    return -total


def dropped_tokens(lay: TokenLayout, keep: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: the token belongs to a sample ``keep`` drops (padding: False)."""
    return ~token_keep(lay, keep) & (lay.sample < lay.num_samples)


def mask_dropped(
    lay: TokenLayout,
    keep: torch.Tensor,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out of place: the loss mask (float32 ones when None) zeroed and labels set to
    ``ignore_index`` on dropped samples."""
    drop_tok = dropped_tokens(lay, keep)
    if loss_mask is None:
        loss_mask = torch.ones(lay.batch, lay.row_length, dtype=torch.float32, device=keep.device)
    loss_mask = loss_mask.masked_fill(drop_tok, 0)
    if labels is not None:
        labels = labels.masked_fill(drop_tok, ignore_index)
    return loss_mask, labels


def kept_tokens(
    loss_mask: torch.Tensor | None, labels: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """The tokens a loss trains on after the drops, a 0-dim device tensor: ``loss_mask.sum()``,
    else ``(labels != ignore_index).sum()``; the per-token loss's denominator (Megatron's
    ``--calculate-per-token-loss``)."""
    if loss_mask is not None:
        return loss_mask.sum()
    if labels is not None:
        return (labels != ignore_index).sum()
    raise MediaInputError("kept_tokens needs a loss_mask or labels")
