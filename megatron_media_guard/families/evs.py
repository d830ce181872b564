"""Efficient video sampling (Nemotron Omni's ``video_pruning_rate > 0``), an ``after_merge``."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from ..core.host import to_host
from .spec import Merged


def prune_video_tokens(model: Any, merged: Merged) -> dict[str, Any]:
    """Efficient video sampling (``video_pruning_rate > 0``): each video's tokens pruned after
    the merge with the model's own ``compute_retention_mask`` on that video's features, as the
    plain forward does, and rows of unequal length right-padded (attention mask 0, labels
    ignored) where the plain forward's ``.view(batch, -1)`` would move tokens between rows."""
    rate = float(getattr(model, "video_pruning_rate", 0) or 0)
    if rate <= 0 or not any(it.modality == "video" for it in merged.items):
        return {}
    runs = [(k, r) for k, r in enumerate(merged.runs()) if r[0].modality == "video"]
    if not runs:
        return {}
    retention = sys.modules[type(model).__module__].compute_retention_mask
    kw = merged.kwargs
    ids = kw["input_ids"]
    keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    video: dict[int, list[int]] = {}  # per video of a kept sample, its runs in order
    for k, (_, _, kept, owner) in runs:
        if kept:
            video.setdefault(owner, []).append(k)
    for group in video.values():
        feats = torch.cat([merged.features[k] for k in group])
        mask = retention(feats, len(group), rate)
        at = 0
        for k in group:
            row, a, b = merged.runs()[k][1]
            keep[row, a:b] = mask[at : at + b - a]
            at += b - a
    lengths = keep.sum(1)
    # the new row lengths: do unequal rows need an attention mask (one small transfer, EVS only)
    n = to_host(lengths, why="row lengths after EVS pruning").tolist()
    width = max(n)
    out: dict[str, Any] = {}
    pad = {"inputs_embeds": 0.0, "input_ids": 0, "attention_mask": 0, "labels": -100}
    for name, fill in pad.items():
        if (t := kw.get(name)) is not None:
            rows = [t[r][keep[r]] for r in range(t.shape[0])]  # rows, not tokens
            out[name] = pad_sequence(rows, batch_first=True, padding_value=fill)
    if kw.get("attention_mask") is None and min(n) != width:
        cols = torch.arange(width, device=ids.device)
        out["attention_mask"] = (cols[None] < lengths[:, None]).long()
    return out
