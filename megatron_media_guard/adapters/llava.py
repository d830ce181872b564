"""Guard for megatron-core ``LLaVAModel._preprocess_data`` (collapsed image tokens).

``install_llava(model, guard)`` wraps the method of one model instance. Before the
original runs, the wrapper checks per sample, with one device-to-host transfer:

- count: the sample's image tokens vs its ``num_image_tiles`` entries (one per image).
  Entries are assigned to samples by item metadata (``handle.set_items`` /
  ``items_provider``: one :class:`MediaItem` per image, ``sample`` set,
  ``num_features = tiles * img_seq_len``) or, without metadata, in token order when
  the batch totals agree. Totals that disagree without metadata cannot be attributed:
  every sample holding an image token is at fault.
- tiles (with metadata): ``num_image_tiles[j] * img_seq_len`` vs the item's features.
- max_length: an image whose expansion ends past ``language_max_sequence_length``
  (megatron-core cuts the merged sequence there without a word).
- nonfinite (``GuardConfig.nonfinite``): NaN/Inf in an image's tiles.
- layout (batch level, always fatal): ``image_embeddings`` is not
  ``[img_seq_len, sum(num_image_tiles), h]``. Tiles are concatenated, so no sample can
  be blamed, and only the first pipeline stage sees them.

Policies: ``raise`` (every rank of the stage raises, naming rank, step, sample, image
and counts); ``drop``; ``repair`` acts as its ``fallback`` here (a fixed-size tile
cannot be re-projected to another count). A dropped sample:

- when the token-order assignment is right (max_length, tiles, nonfinite faults), keeps
  its tokens and tile counts and gets zeros instead of its tiles, so the merged layout,
  the sequence width and every other sample are bit-identical to the unguarded call;
- when it is not (count faults), loses its images: its image tokens become text token 0
  (the embedding megatron-core already computed at those positions), its entries and
  tiles are removed, and the removed tiles stay in the autograd graph through a -0.0
  term. The width may then differ from what the (broken) unguarded call would give.

In both cases its labels become ``ignore_index`` and its loss mask 0 on the outputs.
Every stage computes the same plan from the token ids, the entries and the metadata,
so the last pipeline stage masks the loss of a sample the first stage dropped. A NaN
drop is the exception: only the first stage sees the features, so when it does not
also compute the loss the drop escalates to raise.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import GuardConfig
from ..core.apply import zero_anchor
from ..core.guard import MediaGuard
from ..core.items import MediaItem
from ..core.outcome import LocalOutcome, StageOutcome
from ..core.plan import digest
from ..diagnostics import GuardRecord
from ..errors import MediaInputError
from .hooks import GuardHandle, ItemsProvider, StepProvider, mask_rows
from .llava_checks import (
    ImageFault,
    LlavaFacts,
    column_ranges,
    find_faults,
    llava_grammar,
    measure,
    nonfinite_faults,
    refine_finite,
)

PAD_TOKEN = 0  # what megatron-core's forward embeds at image-token positions
_SEVERITY = {"keep": 0, "drop": 1, "raise": 2}


@dataclass(frozen=True)
class LlavaResult:
    """What one guarded ``_preprocess_data`` call found and did (``handle.last_result``)."""

    step: int | None
    microbatch: int | None
    num_samples: int
    actions: tuple[str, ...]
    faults: tuple[ImageFault, ...]
    mode: str  # "as-is", "zero" (dropped tiles zeroed) or "restructure"
    stage: StageOutcome | None

    @property
    def dropped(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.actions) if a == "drop")

    @property
    def ok(self) -> bool:
        return not self.faults

    @property
    def report(self) -> LlavaResult:
        return self


def install_llava(
    model: Any,
    guard: MediaGuard | None = None,
    *,
    config: GuardConfig | None = None,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    auto_step_end: bool | None = None,
) -> GuardHandle:
    """Guard ``model._preprocess_data`` (a megatron-core ``LLaVAModel`` or any object with
    that method and the attributes it reads). Returns the handle; ``handle.remove()``
    restores the instance. The image token id comes from each call."""
    if guard is None:
        tok = getattr(model, "image_token_index", None)
        guard = MediaGuard(config or GuardConfig(), llava_grammar(-200 if tok is None else tok))
    handle = GuardHandle(
        model,
        "_preprocess_data",
        guard,
        "llava",
        items_provider=items_provider,
        step_provider=step_provider,
        auto_step_end=auto_step_end,
    )
    return handle.install(_make_wrapper)


def _make_wrapper(handle: GuardHandle):
    sig = inspect.signature(handle.original)

    def _preprocess_data(*args: Any, **kwargs: Any) -> Any:
        return _guarded_call(handle, sig, args, kwargs)

    return _preprocess_data


def _variant(m: Any, a: dict[str, Any]) -> tuple[str, int, bool, bool]:
    """``(counts_key, img_seq_len, lengths_known, variant)`` for this release's signature."""
    key = "media_token_counts" if a.get("media_token_counts") is not None else "num_image_tiles"
    packed = key == "media_token_counts" or bool(a.get("is_packed_dynamic_res"))
    L = 1 if packed else int(m.img_seq_len)
    dynamic = a.get("imgs_sizes") is not None and bool(getattr(m, "_dynamic_resolution", False))
    known = not (dynamic and not packed)
    return key, L, known, packed or not known


def _layout_problem(emb, lang, facts: LlavaFacts, variant: bool) -> str | None:
    L, T = facts.img_seq_len, sum(facts.entries)
    if emb.dim() != 3:
        return f"image_embeddings must be [img_seq_len, tiles, h], got {tuple(emb.shape)}"
    if not variant and (emb.shape[0] != L or emb.shape[1] != T):
        return (
            f"image_embeddings is {tuple(emb.shape)}, expected [img_seq_len {L}, {T} tiles "
            f"(sum of num_image_tiles), h]"
        )
    if variant and emb.shape[0] * emb.shape[1] != T * L:
        return f"image_embeddings {tuple(emb.shape)} holds {emb.shape[0] * emb.shape[1]} rows, the entries need {T * L}"
    if lang is not None and emb.shape[2] != lang.shape[-1]:
        return f"image_embeddings hidden size {emb.shape[2]} != language hidden {lang.shape[-1]}"
    return None


def _guarded_call(handle: GuardHandle, sig: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    original, m = handle.original, handle.module
    try:
        ba = sig.bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # let megatron-core report its own signature error
    a = ba.arguments
    if not (m.pre_process or m.post_process) or a.get("use_inference_kv_cache"):
        return original(*args, **kwargs)
    return handle.call("LLaVA media guard", lambda step, mb: _run(handle, ba, step, mb))


def _run(handle: GuardHandle, ba: inspect.BoundArguments, step, mb) -> Any:
    guard, m, a = handle.guard, handle.module, ba.arguments
    where = guard.where(step, mb)
    cfg = guard.config
    items = handle.take_items()
    ids = a["input_ids"]
    tok = int(a["image_token_index"])
    key, L, known, variant = _variant(m, a)
    counts = a.get(key)
    emb = a.get("image_embeddings") if m.pre_process else None
    facts, lay = measure(
        ids,
        tok,
        counts,
        L,
        int(m._language_max_sequence_length),
        emb,
        lengths_known=known,
        check_finite=cfg.nonfinite != "off",
    )
    n, b = facts.num_entries, facts.batch
    faults, owners, consistent = find_faults(facts, lay, items)
    batch_fatal: list[str] = []
    per_col = False
    if emb is not None and n:
        problem = _layout_problem(emb, a.get("language_embeddings"), facts, variant)
        if problem:
            batch_fatal.append(f"layout: {problem}")
        per_col = problem is None and emb.shape[0] == L
    if cfg.nonfinite != "off" and not batch_fatal and per_col:
        facts = refine_finite(facts, emb)
        faults += nonfinite_faults(facts, owners, per_col)
    dropping_policy = cfg.policy if cfg.policy != "repair" else cfg.fallback
    orphans = owners is None and facts.total_tokens == 0 and n > 0
    notes: list[str] = []
    if orphans:
        text = f"unused: {n} num_image_tiles entries for no image token in the batch"
        (batch_fatal if dropping_policy == "raise" else notes).append(text)

    actions = ["keep"] * b
    why_raise: dict[int, str] = {}
    for f in faults:
        act = cfg.nonfinite if f.check == "nonfinite" else dropping_policy
        if f.check == "nonfinite" and act == "drop" and m.pre_process and not m.post_process:
            act, why_raise[f.sample] = "raise", "the last pipeline stage cannot see NaN features"
        if _SEVERITY[act] > _SEVERITY[actions[f.sample]]:
            actions[f.sample] = act
    drops = [i for i, x in enumerate(actions) if x == "drop"]
    mode = "as-is"
    if drops or orphans:
        mode = "zero" if consistent else "restructure"
        blocked = (
            (mode == "zero" and emb is not None and not per_col)
            or (mode == "restructure" and variant)
            or (mode == "restructure" and emb is not None and n and not per_col)
        )
        if blocked:
            shape = None if emb is None else tuple(emb.shape)
            for smp in drops:
                actions[smp] = "raise"
                why_raise[smp] = f"cannot take its tiles out of image_embeddings {shape} ({mode})"
            drops = []
            if orphans:
                batch_fatal.append(f"unused: cannot remove {n} unclaimed entries ({mode})")
            mode = "as-is"
    _emit(guard, faults, actions, batch_fatal, notes, why_raise, items, step, mb)
    local = _outcome(
        guard, facts, owners, faults, actions, batch_fatal, why_raise, items, step, mb, where
    )
    stage = guard.settle(local)
    guard.counters["merges"] += 1
    guard.counters["samples"] += b
    guard.counters["mismatched"] += len({f.sample for f in faults})
    guard.counters["dropped"] += len(drops)
    result = LlavaResult(step, mb, b, tuple(actions), tuple(faults), mode, stage)
    handle.record(result)
    if mode == "as-is":
        return handle.original(*ba.args, **ba.kwargs)
    anchor = _rewrite(ba, m, key, facts, owners, set(drops), mode, emb, lay)
    out = handle.original(*ba.args, **ba.kwargs)
    return _mask_outputs(out, drops, b, cfg.ignore_index, anchor)


def _rewrite(ba, m, key, facts: LlavaFacts, owners, drops: set[int], mode, emb, lay):
    """Rewrite the call's arguments so the original merges only what is kept; returns the
    zero-valued anchor for removed tiles (None when nothing was removed)."""
    a = ba.arguments
    n = facts.num_entries
    gone = [j for j in range(n) if owners is None or owners[j] in drops]
    ranges = column_ranges(facts.entries)
    if mode == "zero":
        if emb is not None and gone:
            keep = torch.ones(emb.shape[1], dtype=torch.bool)
            for j in gone:
                keep[ranges[j][0] : ranges[j][1]] = False
            keep = keep.to(emb.device, non_blocking=True).view(1, -1, 1)
            a["image_embeddings"] = torch.where(keep, emb, emb.new_zeros(()))
        return None
    ids = a["input_ids"]
    rows = torch.zeros(facts.batch, dtype=torch.bool)
    rows[sorted(drops)] = True
    rows = rows.to(ids.device, non_blocking=True)
    a["input_ids"] = ids.masked_fill(rows.unsqueeze(1) & lay.ph.reshape(ids.shape), PAD_TOKEN)
    gone_set = set(gone)
    kept = [j for j in range(n) if j not in gone_set]
    counts = a.get(key)
    if counts is not None:
        a[key] = counts.index_select(0, torch.tensor(kept, dtype=torch.long, device=counts.device))
    if emb is None or not n:
        return None
    cols = [c for j in kept for c in range(*ranges[j])]  # a loop over tiles, not tokens
    drop_cols = [c for j in gone for c in range(*ranges[j])]
    a["image_embeddings"] = (
        emb.index_select(1, torch.tensor(cols, dtype=torch.long, device=emb.device))
        if cols
        else emb.new_zeros((0, 0, emb.shape[2]))
    )
    if not drop_cols:
        return None
    removed = emb.index_select(1, torch.tensor(drop_cols, dtype=torch.long, device=emb.device))
    return zero_anchor(removed)  # -0.0: the exact additive identity, keeps the graph


def _mask_outputs(out: Any, drops: Sequence[int], b: int, ignore_index: int, anchor) -> Any:
    """Labels ignored and loss mask zeroed for dropped rows of the (3- or 5-value) output.

    The outputs are in the expanded layout ``[b, S]`` (each image token became its tiles'
    positions, cut at the max length): no token ids exist for it, so the core's
    token-layout masking (``apply.mask_dropped``) cannot be applied; rows are the samples,
    so :func:`~megatron_media_guard.adapters.hooks.mask_rows` is exact (``handle.mask_loss``
    uses it for LLaVA results too)."""
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        raise MediaInputError(
            f"LLaVA _preprocess_data returned {type(out).__name__} of length "
            f"{len(out) if isinstance(out, (tuple, list)) else '?'}; expected (embeddings, "
            "labels, loss_mask[, ...])"
        )
    vals = list(out)
    if anchor is not None and vals[0] is not None:
        vals[0] = vals[0] + anchor.to(vals[0].dtype)
    if drops:
        vals[2], vals[1] = mask_rows(drops, b, vals[2], vals[1], ignore_index)
    if hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*vals)
    return tuple(vals) if isinstance(out, tuple) else vals


# ---- records, messages, consensus ---------------------------------------------------


def _sample_id(items: Sequence[MediaItem] | None, smp: int):
    if not items:
        return None
    return next(
        (it.sample_id for it in items if it.sample == smp and it.sample_id is not None), None
    )


def _emit(guard, faults, actions, batch_fatal, notes, why_raise, items, step, mb) -> None:
    for f in faults:
        act = actions[f.sample]
        reason = f"{f.check}: {f.reason}"
        if f.sample in why_raise:
            reason += f" (raise: {why_raise[f.sample]})"
        guard.log.emit(
            GuardRecord(
                event="raise" if act == "raise" else "drop",
                step=step,
                microbatch=mb,
                sample=f.sample,
                sample_id=_sample_id(items, f.sample),
                row=f.sample,
                item=f.image,
                modality="image",
                expected=f.expected,
                got=f.got,
                first_mismatch=f.image_in_sample,
                tiles=f.tiles,
                action=act,
                reason=reason,
                extra={"adapter": "llava", "check": f.check},
            ),
            caller="megatron_media_guard.adapters.llava",
        )
    for text, fatal in [(t, True) for t in batch_fatal] + [(t, False) for t in notes]:
        guard.log.emit(
            GuardRecord(
                event="raise" if fatal else "check",
                step=step,
                microbatch=mb,
                action="raise" if fatal else "unused",
                reason=text,
                extra={"adapter": "llava", "check": text.split(":")[0]},
            ),
            caller="megatron_media_guard.adapters.llava",
        )


def _outcome(guard, facts, owners, faults, actions, batch_fatal, why_raise, items, step, mb, where):
    fatal = [i for i, x in enumerate(actions) if x == "raise"]
    message = None
    if fatal or batch_fatal:
        lines = [
            f"Media alignment failed ({where}): LLaVA _preprocess_data, "
            f"{len(fatal)} of {facts.batch} samples"
            + (f" and {len(batch_fatal)} batch-level problem(s)" if batch_fatal else "")
            + ":"
        ]
        lines += [f"  batch {t}" for t in batch_fatal]
        for f in [f for f in faults if actions[f.sample] == "raise"][:8]:
            sid = _sample_id(items, f.sample)
            head = f"  sample {f.sample}" + (f" (sample_id {sid!r})" if sid is not None else "")
            if f.image is not None:
                head += f", image {f.image} (#{f.image_in_sample} in the sample"
                head += f", {f.tiles} tiles)" if f.tiles is not None else ")"
            tail = f" (raise: {why_raise[f.sample]})" if f.sample in why_raise else ""
            lines.append(
                f"{head}: {f.check} - {f.reason}; expected {list(f.expected)}, "
                f"got {list(f.got)}{tail}"
            )
        lines.append(
            f"  batch: {facts.total_tokens} image tokens / {facts.num_entries} num_image_tiles "
            f"entries ({sum(facts.entries)} tiles), img_seq_len {facts.img_seq_len}, "
            f"language_max_sequence_length {facts.max_len}"
        )
        if guard.log.path is not None:
            lines.append(f"  per-rank log: {guard.log.describe_path()}")
        message = "\n".join(lines)
    plan_digest = digest(
        facts.tokens,
        facts.entries,
        owners,
        actions,
        facts.img_seq_len,
        facts.max_len,
        [(f.check, f.sample, f.image) for f in faults],
        batch_fatal,
    )
    return LocalOutcome(
        step=step,
        microbatch=mb,
        digest=plan_digest,
        num_samples=facts.batch,
        mismatched=len({f.sample for f in faults}),
        dropped=sum(1 for x in actions if x == "drop"),
        repaired=0,
        fatal=message is not None,
        fatal_sample=fatal[0] if fatal else None,
        message=message,
    )
