"""Dropping samples of a LLaVA ``_preprocess_data`` call without copying the features: the
small integer inputs rewritten, the dropped positions of the output zeroed, features left
unplaced kept in the graph by :func:`~...core.apply.zero_anchor` (docs/MEGATRON.md, Policies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...core.apply import dropped_tokens, mask_dropped, zero_anchor
from ...families.inputs import placeholders_as_text
from ...families.megatron import LLAVA
from .checks import ImageOwners
from .measure import LlavaFacts
from .packed import PAD_TOKEN, llava_grammar, merged_layout, sample_layout
from .sound import ClipOwners


@dataclass(frozen=True)
class DropPlan:
    """What a drop rewrites. image_targets: image tokens each sample keeps (None: ids
    untouched for images). sound_samples: samples whose sound tokens become token 0;
    clips: clips whose rows become 0. unclaimed: the entries go (no image token at all).
    problem: why the drop cannot be done (the samples then raise)."""

    drops: tuple[int, ...]
    image_targets: tuple[int, ...] | None = None
    sound_samples: tuple[int, ...] = ()
    clips: tuple[int, ...] = ()
    unclaimed: bool = False
    unused_sound: bool = False
    problem: str | None = None

    @property
    def restructures(self) -> bool:
        return bool(self.image_targets or self.sound_samples or self.clips or self.unclaimed)


def _image_targets(facts: LlavaFacts, own: ImageOwners, drops: Sequence[int]):
    """Image tokens per sample after the rewrite, or a reason it is impossible."""
    tgt = list(facts.tokens)
    if own.owners is not None:
        for smp in drops:
            tgt[smp] = len(own.of(smp))
    diff = facts.num_entries - sum(tgt)
    for smp in reversed(drops):  # totals that cannot be assigned: fix them in dropped rows
        if diff < 0:
            cut = min(tgt[smp], -diff)
            tgt[smp], diff = tgt[smp] - cut, diff + cut
        elif diff > 0:
            room = facts.text[smp] - max(0, tgt[smp] - facts.tokens[smp])
            add = max(0, min(diff, room))
            tgt[smp], diff = tgt[smp] + add, diff - add
    if diff:
        return None, "the dropped samples have too few text tokens to take the unclaimed entries"
    for smp in drops:
        if tgt[smp] - facts.tokens[smp] > facts.text[smp]:
            return None, f"sample {smp} has too few text tokens to hold its entries"
    return tuple(tgt), None


def plan_drop(
    facts: LlavaFacts,
    img: ImageOwners,
    snd: ClipOwners | None,
    drops: Sequence[int],
    unclaimed: bool,
    unused_sound: bool,
) -> DropPlan:
    drops = tuple(sorted(drops))
    spans = tuple(facts.spans[i] for i in drops)
    targets, problem = None, None
    if drops and not img.consistent and facts.num_entries + facts.total_tokens:
        targets, problem = _image_targets(facts, img, drops)
        if targets == facts.tokens:
            targets = None
        elif facts.packed and problem is None:
            problem = (
                "its image tokens would have to change, which changes its expansion and moves "
                "the later sub-samples off their cu_seqlens"
            )
    if any(not sp.resolved for sp in spans) and problem is None:
        problem = (
            "its expansion does not fill its cu_seqlens span, so every later sub-sample is "
            "placed off its boundaries"
        )
    sound_samples: tuple[int, ...] = ()
    clips: tuple[int, ...] = ()
    if snd is not None and drops:
        bad = [i for i in drops if not snd.matched[i]]
        sound_samples = tuple(i for i in bad if facts.sound[i])
        clips = tuple(c for i in bad for c in snd.clips[i])
        if (sound_samples or clips) and facts.sound_padded and problem is None:
            problem = "with sound_pad_to_clip_duration every row of a clip is placed"
    return DropPlan(drops, targets, sound_samples, clips, unclaimed, unused_sound, problem)


def _keep(facts: LlavaFacts, gone: Sequence[int], device) -> torch.Tensor:
    """``[samples]`` bool on ``device``: the samples not in ``gone``."""
    return torch.tensor([i not in gone for i in range(facts.batch)]).to(device, non_blocking=True)


def rewrite_inputs(a: dict[str, Any], facts: LlavaFacts, plan: DropPlan) -> Any:
    """Rewrite the call's integer inputs in ``a`` (the bound arguments); returns the zero
    anchor for features megatron-core will not place (None when there are none)."""
    ids = a["input_ids"]
    anchors = []
    if plan.image_targets is not None:
        ph = ids == facts.image_token_index
        tgt = torch.tensor(plan.image_targets, dtype=torch.int64).to(ids.device).view(-1, 1)
        have = torch.tensor(facts.tokens, dtype=torch.int64).to(ids.device).view(-1, 1)
        within = torch.cumsum(ph.to(torch.int64), 1) - 1  # image index within the row
        text = ~ph
        if facts.sound_token_index is not None:
            text &= ids != facts.sound_token_index
        from_end = torch.flip(torch.cumsum(torch.flip(text.to(torch.int64), [1]), 1), [1])
        remove = ph & (within >= tgt)
        add = text & (from_end <= (tgt - have).clamp(min=0))
        ids = torch.where(remove, PAD_TOKEN, torch.where(add, facts.image_token_index, ids))
    if plan.sound_samples:  # the one rewrite of placeholders to text, on the sound tokens
        snd = llava_grammar(facts.sound_token_index, "sound")  # type: ignore[arg-type]
        lay = sample_layout(ids, snd, facts.spans, facts.packed)
        keep = _keep(facts, plan.sound_samples, ids.device)
        ids = placeholders_as_text(LLAVA, {"input_ids": ids}, lay, keep, PAD_TOKEN)["input_ids"]
    a["input_ids"] = ids
    lens = a.get("sound_embeddings_len")
    if plan.clips and lens is not None:
        idx = torch.tensor(plan.clips, dtype=torch.long).to(lens.device)
        a["sound_embeddings_len"] = lens.index_fill(0, idx, 0)
    if (plan.clips or plan.unused_sound) and a.get("sound_embeddings") is not None:
        anchors.append(a["sound_embeddings"])
    if plan.unclaimed:
        emb, counts = a.get("image_embeddings"), a.get("num_image_tiles")
        if counts is not None:
            a["num_image_tiles"] = counts[:0]
        if emb is not None:
            anchors.append(emb)
            a["image_embeddings"] = emb[:0]
    return zero_anchor(*anchors) if anchors else None


def finish_outputs(
    out: Any, plan: DropPlan, facts: LlavaFacts, ignore_index: int, seq_first: bool, anchor
) -> tuple:
    """megatron-core's ``(embeddings, labels, loss_mask)`` with the dropped samples' positions
    of the expanded layout zeroed (in place) and their loss masked (core's
    :func:`mask_dropped`), and the zero anchor added to one element."""
    emb, labels, lmask = out
    ref = labels if labels is not None else lmask
    if ref is None and emb is not None:
        ref = emb[:, :, 0].t() if seq_first else emb[:, :, 0]
    if ref is not None and ref.numel() and plan.drops:
        lay = merged_layout(facts.spans, facts.packed, tuple(ref.shape[:2]), ref.device)
        keep = _keep(facts, plan.drops, ref.device)
        if emb is not None:
            gone = dropped_tokens(lay, keep)
            emb.masked_fill_((gone.t() if seq_first else gone).unsqueeze(-1), 0)  # fresh output
        if labels is not None or lmask is not None:
            masked, labels = mask_dropped(lay, keep, lmask, labels, ignore_index)
            lmask = masked if lmask is not None else None
    if anchor is not None and emb is not None and emb.numel():
        emb[(0,) * emb.dim()].add_(anchor.to(emb.dtype))  # -0.0: no bit changes
    return emb, labels, lmask
