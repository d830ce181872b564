"""Batches for the derived-family cases (``derived_models.py``; tests and benchmarks only).

:func:`make_batch` lays each item's runs in the ids from the model's *own* feature method on
that item alone (one run per element / row of its output: an image, a tile, a clip), with one
text token between runs (a tile separator) and text around items; ``Media(..., tokens=n)`` gives
the item ``n`` placeholders in all (its last run absorbs the difference), ``swap=(modality, i,
j)`` exchanges two items' inputs, the ids unchanged. A sample's text and media depend on its
content only, so a sample built alone is the same sample.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from .derived_models import Case
from .families.base import FamilyBatch, Media, right_pad, rng

TEXT_LO, TEXT_HI = 1000, 1900


def owner(model):
    return model.model if hasattr(model, "model") else model


def own_runs(case: Case, model, modality: str, inputs: dict) -> list[int]:
    """The lengths of one item's runs, from the model's own feature method on it alone."""
    kw = case.collate([(0, modality, inputs)])
    o = owner(model)
    fn = getattr(o, f"get_{modality}_features")
    names = inspect.signature(fn).parameters
    with torch.no_grad():
        out = fn(**{k: v for k, v in kw.items() if k in names}, return_dict=True)
    feats = getattr(out, case.attr.get(modality, "pooler_output"))
    if isinstance(feats, (list, tuple)):  # an element [k, L, h]: k tiles (Idefics3)
        return [int(f.shape[-2]) for f in feats for _ in range(f.shape[0] if f.dim() == 3 else 1)]
    if feats.dim() == 3 and getattr(out, "attention_mask", None) is not None:
        return [int(out.attention_mask.sum())]
    if feats.dim() == 3:
        return [int(feats.shape[1])] * int(feats.shape[0])
    return [int(feats.shape[0])]


def placeholder(model, modality: str) -> int:
    cfg = model.config
    return int(
        getattr(cfg, f"{modality}_token_id", None) or getattr(cfg, f"{modality}_token_index")
    )


def make_batch(
    case: Case,
    model,
    samples: Sequence[Sequence[Media]],
    *,
    swap: tuple[str, int, int] | None = None,
    seed: int = 0,
) -> FamilyBatch:
    """Ids and media inputs (module docstring); ``batch.items``: (sample, modality, count)."""
    rows, runs, media, items = [], [], [], []
    for s, sample in enumerate(samples):
        g = rng(seed, [(m.modality, m.size) for m in sample])  # the same whatever else
        row = torch.randint(TEXT_LO, TEXT_HI, (4,), generator=g).tolist()
        sruns = []
        for m in sample:
            inputs = case.item(m.modality, m.size, g)
            lens = own_runs(case, model, m.modality, inputs)
            if m.tokens is not None:
                lens[-1] += m.tokens - sum(lens)
            ph = placeholder(model, m.modality)
            for n in lens:
                row += [ph] * n + torch.randint(TEXT_LO, TEXT_HI, (1,), generator=g).tolist()
            row += torch.randint(TEXT_LO, TEXT_HI, (3,), generator=g).tolist()
            sruns += [(m.modality, n) for n in lens]
            media.append([s, m.modality, inputs])
            items.append((s, m.modality, sum(lens)))
        rows.append(row)
        runs.append(sruns)
    if swap is not None:
        mod, i, j = swap
        idx = [k for k, it in enumerate(media) if it[1] == mod]
        a, b = idx[i], idx[j]
        media[a][2], media[b][2] = media[b][2], media[a][2]
    ids, attn = right_pad(rows, TEXT_LO)
    kwargs = {"input_ids": ids, "attention_mask": attn}
    kwargs.update(case.collate([tuple(x) for x in media]))
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["token_type_ids"] = torch.zeros_like(ids)
    return FamilyBatch(kwargs, items, runs, [len(r) for r in rows])


def hidden(model, kwargs: dict) -> torch.Tensor:
    """The decoder's last hidden states of one forward (no logits over the vocabulary)."""
    seen = []
    dec = model.get_decoder()
    dec = getattr(dec, "model", dec)  # Llama 4's decoder is a ...ForCausalLM
    hook = dec.register_forward_hook(lambda m, a, o: seen.append(o[0]))
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if keep and "labels" not in kwargs else {}
    try:
        with torch.no_grad():
            model(**kwargs, **extra)
    except AttributeError as e:  # Llama 4 (5.24): its output fails after the decoder ran
        if not seen or "image_outputs" not in str(e):
            raise
    finally:
        hook.remove()
    return seen[-1]


__all__ = ["hidden", "make_batch", "own_runs"]
