"""Guard for megatron-core ``LLaVAModel._preprocess_data`` (docs/MEGATRON.md): ``install_llava``
hooks the method of one instance (and, on an ``nn.Module``, a pre on ``forward`` that captures
``packed_seq_params``, which never reach ``_preprocess_data``). Each call is measured in one
transfer (:mod:`.measure`), checked (:mod:`.checks`, :mod:`.sound`), planned per sample and
ended by core's :func:`~...core.fault_path.conclude`; ``drop`` rewrites the inputs
(:mod:`.drop`), ``repair`` acts as its ``fallback``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from ...config import GuardConfig
from ...core.fault_path import conclude, save_replay
from ...core.faults import FaultContext, ItemFault, batch_records, fault_records
from ...core.generated import text_records
from ...core.grammar import Grammar
from ...core.guard import MediaGuard
from ...core.items import MediaItem
from ...core.outcome import StageOutcome
from ...core.plan import Plan, digest, dropping_action, worst
from ...core.runs import TokenLayout
from ...errors import MediaInputError
from ..forward_hook import CallArgs
from ..hooks import GuardHandle, ItemsProvider, StepProvider
from ..vlm_inputs import packed_offsets
from .checks import (
    generated_as_text,
    generated_faults,
    image_faults,
    layout_problems,
    llava_grammar,
    per_sample,
    split_items,
)
from .drop import finish_outputs, plan_drop, rewrite_inputs
from .measure import LlavaFacts, measure, refine_finite
from .packed import PAD_TOKEN, Span, merged_layout
from .sound import sound_faults


@dataclass(frozen=True)
class LlavaResult:
    """What one guarded ``_preprocess_data`` call found and did (``handle.last_result``);
    spans: where each sample lies (rows, or packed sub-samples of ``cu_seqlens``)."""

    step: int | None
    microbatch: int | None
    num_samples: int
    actions: tuple[str, ...]
    faults: tuple[ItemFault, ...]
    mode: Literal["as-is", "zero", "restructure"]  # zero: the dropped positions zeroed
    stage: StageOutcome | None
    spans: tuple[Span, ...] = ()
    packed: bool = False

    @property
    def dropped(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.actions) if a == "drop")

    @property
    def ok(self) -> bool:
        return not self.faults

    @property
    def report(self) -> LlavaResult:
        return self

    def layout(self, t: torch.Tensor) -> TokenLayout:
        """The call's samples in a ``[b, S]`` tensor of the expanded output (``t``: a loss
        mask or labels): its rows, or the packed sub-samples' merged spans."""
        rows = 1 if self.packed else self.num_samples
        if t.dim() != 2 or t.shape[0] != rows:
            raise MediaInputError(
                f"mask_loss takes [b, S] tensors of the expanded output, one row per sample "
                f"({rows}), got {tuple(t.shape)}"
            )
        return merged_layout(self.spans, self.packed, tuple(t.shape), t.device)


class LlavaHandle(GuardHandle):
    """A :class:`GuardHandle` that also holds the next call's ``packed_seq_params`` (from the
    pre on ``forward``, or :meth:`set_packed_seq_params`)."""

    _packed: tuple[Any, Any] = (None, None)

    def set_packed_seq_params(self, packed_seq_params: Any, position_ids: Any = None) -> None:
        """``PackedSeqParams`` (and the forward's ``position_ids``, which restart at each
        sub-sample) for the next guarded call; consumed by it."""
        self._packed = (packed_seq_params, position_ids)

    def take_packed(self) -> tuple[Any, Any]:
        out, self._packed = self._packed, (None, None)
        return out

    def _around(self, original: Any, args: tuple, kwargs: dict) -> Any:
        try:
            ba = self._sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let megatron-core report its own signature error
        m = self.module
        if not (m.pre_process or m.post_process) or ba.arguments.get("use_inference_kv_cache"):
            self.take_packed()
            return original(*args, **kwargs)
        return self.call("LLaVA media guard", lambda step, mb: _run(self, ba, step, mb))


def llava_model_grammar(model: Any) -> Grammar:
    """The collapsed grammar of ``model.image_token_index`` (megatron-core's -200 when unset)."""
    tok = getattr(model, "image_token_index", None)
    return llava_grammar(-200 if tok is None else tok)


def install_llava(
    model: Any,
    guard: MediaGuard | None = None,
    *,
    config: GuardConfig | None = None,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    auto_step_end: bool | None = None,
) -> LlavaHandle:
    """Guard ``model._preprocess_data`` (a megatron-core ``LLaVAModel`` or any object with
    that method and the attributes it reads; Megatron-Bridge's ``NemotronVLModel`` /
    ``NemotronOmniModel`` wrappers are guarded through the ``LLaVAModel`` at their
    ``.llava_model``). Returns the handle; ``handle.remove()`` restores the instance. The
    image token id comes from each call."""
    inner = getattr(model, "llava_model", None)
    if not callable(getattr(model, "_preprocess_data", None)) and inner is not None:
        model = inner  # a wrapper's forward calls it: the forward pre-hook sees its arguments
    if guard is None:
        guard = MediaGuard(config, llava_model_grammar(model))
    handle = LlavaHandle(
        model,
        "_preprocess_data",
        guard,
        "llava",
        items_provider=items_provider,
        step_provider=step_provider,
        auto_step_end=auto_step_end,
    )
    handle.install(handle._around)
    handle._sig = inspect.signature(handle.original)
    if isinstance(model, torch.nn.Module):
        fsig = inspect.signature(model.forward)

        def capture(args: tuple, kwargs: dict) -> None:
            try:
                call = CallArgs(fsig, args, kwargs)
            except TypeError:  # the forward reports its own signature error
                return
            psp = call.get("packed_seq_params")
            handle._packed = (psp, call.get("position_ids") if psp is not None else None)

        try:
            handle.hook(model, "forward", pre=capture)
        except MediaInputError:
            handle.remove()
            raise
    return handle


def _checks(handle: LlavaHandle, a: dict[str, Any], cu, pos, img_items, snd_items):
    """The facts of one call and what they show: ``(facts, batch_fatal, faults, img_own,
    clip_own)``."""
    m, cfg = handle.module, handle.guard.config
    facts = measure(a, m, cu_seqlens=cu, position_ids=pos, check_finite=cfg.nonfinite != "off")
    batch_fatal, img_ok, snd_ok = layout_problems(a, m, facts)
    if not img_ok:
        facts = replace(facts, entry_bad=())  # the images' layout is not known
    if any(facts.entry_bad) or (any(facts.clip_bad) and snd_ok):
        facts = refine_finite(facts, a, snd_ok)
    faults, img_own = image_faults(facts, img_items, a["input_ids"])
    more, clip_own = sound_faults(facts, snd_items, snd_ok)
    return facts, batch_fatal, faults + more, img_own, clip_own


def _run(handle: LlavaHandle, ba: inspect.BoundArguments, step, mb) -> Any:
    guard, m, a = handle.guard, handle.module, ba.arguments
    cfg = guard.config
    img_items, snd_items = split_items(handle.take_items())
    psp, pos = handle.take_packed()
    cu = packed_offsets({"packed_seq_params": psp}, a["input_ids"])
    cu = cu if cu is not None and cu.numel() >= 2 else None
    pos = pos if cu is not None and isinstance(pos, torch.Tensor) else None
    checked = _checks(handle, a, cu, pos, img_items, snd_items)
    # an image token too many may be one the policy generated (fault path only): fed as text
    # (token 0, as the forward embedded it), then checked again
    gen = generated_as_text(a, cfg.ignore_index) if _count_fault(checked[2]) else None
    if gen is not None:
        checked = _checks(handle, a, cu, pos, img_items, snd_items)
    facts, batch_fatal, faults, img_own, clip_own = checked
    if gen is not None:
        gen = per_sample(gen, facts.spans)
        faults += generated_faults(gen, cfg.generated)
    dropping_policy = dropping_action(cfg)
    n = facts.num_entries
    unclaimed = img_own.owners is None and facts.total_tokens == 0 and n > 0
    unused_sound = clip_own is not None and facts.num_clips > 0 and not any(facts.sound)
    notes: list[str] = []
    if unclaimed:
        text = f"unused: {n} num_image_tiles entries for no image token in the batch"
        (batch_fatal if dropping_policy == "raise" else notes).append(text)
        unclaimed = dropping_policy != "raise"  # the entries go (under raise: fatal)
    if unused_sound:
        notes.append(f"unused: {facts.num_clips} sound clips for no sound token in the batch")

    actions = ["keep"] * facts.batch
    why_raise: dict[int, str] = {}
    first_only = m.pre_process and not m.post_process
    for f in faults:
        act = {"nonfinite": cfg.nonfinite, "generated": cfg.generated}.get(f.check, dropping_policy)
        if act == "drop" and first_only and (f.check == "nonfinite" or f.modality == "sound"):
            act = "raise"
            why_raise[f.sample] = f"the last pipeline stage cannot see the {f.modality} embeddings"
        actions[f.sample] = worst(act, actions[f.sample])
    drops = [i for i, x in enumerate(actions) if x == "drop"]
    plan = None
    if drops or unclaimed:
        plan = plan_drop(facts, img_own, clip_own, drops, unclaimed, unused_sound)
        if plan.problem:
            for smp in drops:
                actions[smp], why_raise[smp] = "raise", f"cannot drop: {plan.problem}"
            plan = None

    # the records, the raise message and the plan, agreed with the stage by core's conclusion
    sids = {it.sample: it.sample_id for it in reversed(img_items or ()) if it.sample_id is not None}
    ctx = FaultContext("llava", lambda smp: facts.spans[smp].row, sids.get, why_raise)
    recs = [
        *fault_records(faults, actions, ctx, step=step, microbatch=mb),
        *batch_records(batch_fatal, notes, ctx.adapter, step, mb),
    ]
    if gen is not None and cfg.generated == "text":
        kept = {s for s, x in enumerate(actions) if x == "keep"}
        recs += [
            replace(rec, extra={**rec.extra, "adapter": "llava"})
            for rec in text_records(gen, step, mb, PAD_TOKEN, kept)
        ]
    found = [(f.check, f.modality, f.sample, f.item) for f in faults]
    owners = img_own.owners
    planned = (facts.tokens, facts.entries, owners, actions)
    plan_digest = digest(*planned, facts.img_seq_len, facts.max_len, found, batch_fatal)
    stage = conclude(
        guard,
        Plan(tuple(actions), (), plan_digest),
        recs,
        step=step,
        microbatch=mb,
        mismatched=len({f.sample for f in faults}),
        summary=_summary(facts),
        what="LLaVA _preprocess_data",
        unit="packed sub-samples" if facts.packed else "samples",
        caller="megatron_media_guard.adapters.llava",
        bundle=_bundle(guard, facts, faults, owners, img_items, a["input_ids"], step, mb),
        samples=facts.batch,
    )
    mode = "as-is" if plan is None else ("restructure" if plan.restructures else "zero")
    result = LlavaResult(
        step, mb, facts.batch, tuple(actions), tuple(faults), mode, stage, facts.spans, facts.packed
    )
    handle.record(result)
    if plan is None:
        return handle.original(*ba.args, **ba.kwargs)
    anchor = rewrite_inputs(a, facts, plan)
    out = handle.original(*ba.args, **ba.kwargs)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise MediaInputError(
            f"LLaVA _preprocess_data returned {type(out).__name__}"
            f"{f' of length {len(out)}' if isinstance(out, (tuple, list)) else ''}; "
            "megatron-core returns (embeddings, labels, loss_mask)"
        )
    seq_first = getattr(m, "context_parallel_lm", 1) == 1
    return finish_outputs(out, plan, facts, cfg.ignore_index, seq_first, anchor)


def _count_fault(faults: list[ItemFault]) -> bool:
    """An image token too many or too few in a sample."""
    return any(f.check == "count" and f.modality == "image" for f in faults)


def _summary(facts: LlavaFacts) -> str:
    out = (
        f"{facts.total_tokens} image tokens / {facts.num_entries} num_image_tiles "
        f"entries ({sum(facts.entries)} tiles), img_seq_len {facts.img_seq_len}, "
        f"language_max_sequence_length {facts.max_len}"
    )
    if facts.clip_rows or any(facts.sound):
        out += (
            f"; {sum(facts.sound)} sound tokens / {sum(facts.clip_rows)} rows in "
            f"{facts.num_clips} clips"
        )
    return out


def _bundle(guard, facts: LlavaFacts, faults, owners, items, ids, step, mb):
    """The replay bundle's saver, for the faults a replay can re-run: an image token too many
    or too few in a sample (a collapsed grammar's replay checks the runs per sample). The
    other checks (tiles, sequence length, NaN/Inf, sound, packed spans) read facts the bundle
    does not hold: no bundle."""
    if facts.packed or not _count_fault(faults):
        return None
    if items is None:
        L = facts.img_seq_len
        items = [
            MediaItem(t * L, modality="image", sample=None if owners is None else owners[j])
            for j, t in enumerate(facts.entries)
        ]
    return lambda: save_replay(
        guard, input_ids=ids, items=items, cu_seqlens=None, step=step, microbatch=mb, report=None
    )
