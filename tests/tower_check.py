"""The keep_tower check every embed-mode family's tests share (issue 20, docs/PARALLEL.md).

A text-only call under ``GuardConfig(keep_tower=mode)`` runs the model's own tower once, before
the decoder, only under ``"always"``, kept at a zero weight: every tower parameter a real media
batch trains gets an exact zero gradient (None under the other modes) and the output is the
plain model's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_media_guard import GuardConfig
from megatron_media_guard.adapters import install_vlm


def check_keeps_tower(
    model: torch.nn.Module,
    mode: str,
    runs: int,
    *,
    media: dict,
    text: dict,
    towers: Sequence[torch.nn.Module],
    decoder: torch.nn.Module,
    tokenizer: Any = None,
    out: Callable[[Any], torch.Tensor] = lambda o: o.logits,
) -> None:
    """``media`` / ``text``: forward kwargs of a media batch and of a text-only batch;
    ``towers``: the modules whose parameters are checked (tower and projector); ``decoder``:
    the module whose forward marks the decoder."""
    params = [p for t in towers for p in t.parameters()]
    model.zero_grad(set_to_none=True)
    out(model(**media)).float().sum().backward()
    used = [p.grad is not None for p in params]
    model.zero_grad(set_to_none=True)
    order: list[str] = []
    hooks = [t.register_forward_hook(lambda *a: order.append("tower")) for t in towers[:1]]
    hooks.append(decoder.register_forward_hook(lambda *a: order.append("decoder")))
    try:
        with torch.no_grad():
            ref = out(model(**text))
        order.clear()
        with install_vlm(model, GuardConfig(keep_tower=mode), tokenizer=tokenizer):
            got = out(model(**text))
        got.float().sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(got, ref)
    assert order == ["tower"] * runs + ["decoder"]
    grads = [p.grad for p, u in zip(params, used, strict=True) if u]
    assert grads
    if runs:
        assert all(g is not None and not g.any() for g in grads)
    else:
        assert all(g is None for g in grads)
    model.zero_grad(set_to_none=True)
