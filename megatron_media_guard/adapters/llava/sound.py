"""Sound as a LLaVA modality (megatron-core 0.19): one ``sound_embeddings`` row per sound
token; clips to samples and the checks: docs/MEGATRON.md, Checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...core.faults import ItemFault
from ...core.items import MediaItem
from .checks import item_owners, nonfinite_fault
from .measure import LlavaFacts


@dataclass(frozen=True)
class ClipOwners:
    """Clips of each sample; ``matched``: its sound tokens match its clips' rows."""

    clips: tuple[tuple[int, ...], ...]
    matched: tuple[bool, ...]


def _walk(tokens: Sequence[int], rows: Sequence[int]) -> tuple[list[list[int]], int]:
    """Clips of the leading samples whose sound tokens are whole clips, and how many."""
    out: list[list[int]] = []
    c = 0
    for need in tokens:
        mine, got, d = [], 0, c
        while d < len(rows) and got < need:
            mine.append(d)
            got += rows[d]
            d += 1
        if got != need:
            break
        out.append(mine)
        c = d
    return out, c


def clip_owners(facts: LlavaFacts, items: Sequence[MediaItem] | None) -> ClipOwners:
    """Clips per sample: by the items, else by the two walks (docs/MEGATRON.md, Checks); the
    samples between the walks are unmatched, the first of them taking the clips left between."""
    B, rows, C = facts.batch, facts.clip_rows, len(facts.clip_rows)
    if items is not None:
        owners = item_owners(items, C, B, "sound")
        clips = tuple(tuple(c for c, o in enumerate(owners) if o == smp) for smp in range(B))
        matched = tuple(facts.sound[i] == sum(rows[c] for c in clips[i]) for i in range(B))
        return ClipOwners(clips, matched)
    front, cf = _walk(facts.sound, rows)
    if len(front) == B and cf == C:
        return ClipOwners(tuple(tuple(x) for x in front), (True,) * B)
    back_rev, _ = _walk(facts.sound[::-1], rows[::-1])
    back = [tuple(C - 1 - c for c in reversed(x)) for x in reversed(back_rev)]
    lo, hi = len(front), B - len(back)  # front matched [0, lo), back matched [hi, B)
    first = min(lo, max(hi - 1, 0), B - 1)
    last = min(max(lo, hi - 1), B - 1)
    a = sum(len(front[i]) for i in range(first))
    e = C - sum(len(back[i - hi]) for i in range(last + 1, B))
    clips = [tuple(front[i]) for i in range(first)]
    clips += [tuple(range(a, max(a, e)))] + [()] * (last - first)
    clips += [back[i - hi] for i in range(last + 1, B)]
    matched = tuple(not first <= i <= last for i in range(B))
    return ClipOwners(tuple(clips), matched)


def sound_faults(
    facts: LlavaFacts, items: Sequence[MediaItem] | None, sound_known: bool
) -> tuple[list[ItemFault], ClipOwners | None]:
    """Count, max-length and NaN/Inf faults of the sound; ``([], None)`` where this stage does
    not see it or the model has no sound token."""
    if not sound_known or facts.sound_token_index is None:
        return [], None
    own = clip_owners(facts, items)
    rows = facts.clip_rows
    out: list[ItemFault] = []
    for smp in range(facts.batch):
        mine = own.clips[smp]
        got = sum(rows[c] for c in mine)
        k = facts.sound[smp]
        if not own.matched[smp]:
            if k == 0 and not mine:
                continue
            clips = f"its clip(s) {list(mine)} {got} sound_embeddings_len rows"
            batch = f"{sum(facts.sound)} sound tokens, {sum(rows)} rows in {len(rows)} clips"
            out.append(
                ItemFault(
                    smp,
                    "count",
                    "sound",
                    f"sample holds {k} sound tokens, "
                    f"{clips if mine else 'no clip can be assigned to it'} (batch: {batch})",
                    item=mine[0] if mine else None,
                    item_in_sample=0 if mine else None,
                    expected=(k,),
                    got=(got,),
                )
            )
            continue
        if facts.sound_past[smp] and mine:
            past = facts.sound_past[smp]
            out.append(
                ItemFault(
                    smp,
                    "max_length",
                    "sound",
                    f"{past} of the sample's {k} sound rows fall past "
                    f"language_max_sequence_length {facts.max_len}: megatron-core would cut "
                    "them after the merge",
                    item=mine[-1],
                    item_in_sample=len(mine) - 1,
                    expected=(k,),
                    got=(k - past,),
                )
            )
        if facts.clip_bad:
            why = "NaN/Inf in the clip's sound embeddings (got: rows affected)"
            out += nonfinite_fault(smp, "sound", mine, facts.clip_bad, rows, why)
    return out, own
