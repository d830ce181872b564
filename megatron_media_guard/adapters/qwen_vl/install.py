"""Guard for Qwen2-VL / Qwen2.5-VL / Qwen3-VL: checks and rewrites the forward's inputs before
the vision tower runs (transformers' ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen2_5_VLModel``
/ ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLModel``, Megatron-Bridge's ``Qwen25VLModel`` /
``Qwen3VLModel``).

These models merge inline in ``forward`` (no method to wrap), and every item's feature count is
a pure function of its grid row, which also drives MRoPE and (Qwen3-VL) the deepstack
injections. So the guard is a forward pre-hook (keyword arguments) on the model instance: it
checks the placeholder runs in ``input_ids`` against the grid rows, and when they disagree it
repairs (the item's patches resized to the solved grid, its grid row replaced), drops (rows out
of the pixels and grids, placeholders to text, labels ignored, loss mask 0) or raises, then lets
the model's own forward run untouched on inputs that agree. The vision tower runs once. See
docs/QWEN_VL.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ...core.conclude import conclude
from ...core.explain import batch_summary
from ...core.fault_path import save_replay
from ...core.generated import as_text, find_generated, text_records
from ...core.guard import MediaGuard
from ...core.outcome import GuardReport, LocalOutcome, MergeResult
from ...core.plan import Plan, build_plan, digest
from ...core.runs import TokenLayout, parse_layout
from ...core.verify import Verdict
from ...errors import MediaInputError
from ...families import qwen
from ..forward_hook import CallArgs, ForwardHookHandle
from ..hooks import ItemsProvider, StepProvider
from ..tower import tower_due
from .checks import (
    GRIDS,
    MODALITIES,
    PIXELS,
    TYPE_INPUTS,
    GridCheck,
    QwenVLSpec,
    check_grids,
    meta_tensors,
    packed_offsets,
    spec_from_model,
)
from .plan import (
    CALLER,
    check_record,
    grid_note,
    host_rows,
    plan_call_records,
    refuse,
    report_for,
    run_row_repairs,
    split_rows,
    token_items,
)
from .rewrite import dummy_cell, follow_ids, removed_rows, rewrite

MARK = "_media_guard_qwen_vl"


class QwenVLHandle(ForwardHookHandle):
    """The installed pre-hook (and its post-forward hook) on one Qwen-VL model instance.

    When a call feeds the vision tower nothing (all its media dropped; text-only too under
    ``keep_tower="always"``), the pre-hook runs the tower on a dummy cell before the model's
    body and ``keeper`` (:class:`~..tower.TowerKeeper`) keeps it at a zero weight in the input
    embeddings (else the output), so data-parallel wrappers see it as in any other step.

    ``last_result``: a :class:`MergeResult` (``embeddings`` None) whose report holds the
    actions per sample; ``mask_loss(loss_mask, labels)`` applies its drops for a loss computed
    outside the model. ``set_items``: one :class:`MediaItem` per grid row (image rows, then
    video rows) adding ``sample``, ``sample_id`` and ``source_hw``.
    """

    MARK = MARK

    def __init__(
        self,
        model: Any,
        guard: MediaGuard,
        spec: QwenVLSpec,
        *,
        loss_mask_inplace: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(model, guard, "qwen_vl", **kw)
        self.spec = spec
        # the repair geometry: the guard's, else the one the model's config gives
        self.geometry = guard.geometry if guard.geometry is not None else qwen.geometry(model)
        self.loss_mask_inplace = loss_mask_inplace

    # ---- hooks ----------------------------------------------------------------------

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.keeper.clear()
        try:
            call = CallArgs(self.sig, args, kwargs)
        except TypeError:
            return None  # the model reports its own signature error
        if call.get("mm_encoder_outputs") is not None:
            return None  # encoded before the forward (transformers' generate): nothing to rewrite
        had = _feeds_tower(call)
        ids = call.get("input_ids")
        new = None
        if isinstance(ids, torch.Tensor):  # inputs_embeds only: no token ids to check
            new = self.call("Qwen-VL media guard", lambda step, mb: self._run(call, ids, step, mb))
        self._keep_tower(module, call, had, ids)
        return new

    def _keep_tower(self, module: Any, call: CallArgs, had: bool, ids: Any) -> None:
        """The tower on a dummy cell now, before the model's body, when this call feeds it
        nothing (see adapters/tower.py). A call with a KV cache (a decoding step) is not a
        text-only micro-batch."""
        mode = self.guard.config.keep_tower
        if not had and call.get("past_key_values") is not None:
            return
        if not tower_due(mode, had_media=had, feeds_media=_feeds_tower(call)):
            return
        ref = ids if isinstance(ids, torch.Tensor) else call.get("inputs_embeds")
        device = ref.device if isinstance(ref, torch.Tensor) else torch.device("cpu")
        run = dummy_cell(module, self.spec, device)
        if run is not None:
            self.keeper.run(run)

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return self.keeper.attach(out)

    # ---- one call -------------------------------------------------------------------

    def _run(self, call: CallArgs, ids: torch.Tensor, step, mb):
        guard, spec = self.guard, self.spec
        cu = packed_offsets(call, ids)
        lay = TokenLayout(ids, guard.grammar, cu)
        grids = {m: call.get(GRIDS[m]) for m in MODALITIES}
        pix = {m: call.get(PIXELS[m]) for m in MODALITIES}
        for m in MODALITIES:
            if pix[m] is not None and grids[m] is None:
                raise MediaInputError(f"{PIXELS[m]} given without {GRIDS[m]}")
        meta = self.take_items()
        samples, declared, ordered = meta_tensors(meta, grids, lay.num_samples)
        rows_px = {m: (None if pix[m] is None else int(pix[m].shape[0])) for m in MODALITIES}
        types = {n: call.get(n) for n in TYPE_INPUTS if call.get(n) is not None}
        check = check_grids(lay, ids, grids, rows_px, spec, samples, declared, types)
        if check.pixel_rows_bad:
            raise MediaInputError(
                "pixel rows disagree with the grids (pixel_values must hold sum(t*h*w) "
                f"patches per modality: {rows_px})"
            )
        guard.counters["merges"] += 1
        guard.counters["samples"] += lay.num_samples
        if check.types_bad:  # the ids are the truth: the token types / masks follow them
            self._note(
                step,
                mb,
                "rebuilt",
                f"{check.types_bad} positions of "
                f"{sorted(types)} disagree with input_ids: rebuilt from the ids",
            )
        if check.aligned and ordered:
            plan = Plan(("keep",) * lay.num_samples, (), self._digest(check, None))
            stage = guard.settle(LocalOutcome.of_plan(plan, step, mb))
            self._result(plan, None, check, stage, step, mb, ids, cu, None)
            if check.types_bad:
                follow_ids(call, spec, ids)
                return call.rebuild()
            return None
        if not ordered:  # explicit samples: rows are put back in token order (no resize)
            self._note(
                step,
                mb,
                "reordered",
                "grid rows out of token order (set_items samples "
                "decrease): the rows are fed in sample order",
            )
        return self._diagnose(call, ids, cu, lay, grids, pix, meta, check, step, mb)

    def _note(self, step, mb, action: str, reason: str) -> None:
        """A ``check`` record: the inputs were put right without touching any sample."""
        check_record(self.guard, step, mb, action, reason)

    def _digest(self, check: GridCheck, plan: Plan | None) -> int:
        cfg = self.guard.config
        knobs = [cfg.policy, cfg.fallback, list(cfg.allowed_fidelity)]
        return digest(check.fingerprint, check.runs, knobs, None if plan is None else plan.digest)

    def _diagnose(self, call, ids, cu, lay, grids, pix, meta, check, step, mb):
        guard, spec, cfg = self.guard, self.spec, self.guard.config
        rows = host_rows(grids, spec)
        labels, lmask = call.get("labels"), call.get("loss_mask")
        gen = None
        if labels is not None or lmask is not None:  # placeholders the policy generated
            gen = find_generated(lay, labels, lmask, cfg.ignore_index)
        if gen is not None:  # read as text from here on, and fed to the model as text
            ids, lay = as_text(ids, gen, spec.text_id, cu, guard.grammar)
            call.set("input_ids", ids)
        parsed = parse_layout(lay)
        items, item_row = token_items(rows, parsed, spec, pix, meta)
        report = report_for(parsed, items)
        verdict = Verdict(check.runs, check.bad, check.findings, 0, check.fingerprint)
        plan = build_plan(lay.num_samples, items, verdict, report, cfg, generated=gen)
        plan = refuse(plan, split_rows(report, item_row, rows), cfg)
        repairs, failed = {}, {}
        if plan.repairs:
            repairs, failed = run_row_repairs(
                guard,
                spec,
                plan,
                rows,
                items,
                item_row,
                pix,
                geometry=self.geometry,
                step=step,
                microbatch=mb,
            )
        actions = [cfg.fallback if s in failed else a for s, a in enumerate(plan.actions)]
        actions, gone = removed_rows(report, item_row, actions, cfg)
        kept = [r for r in plan.repairs if actions[r.sample] == "repair"]
        repairs = {ri: rr for ri, rr in repairs.items() if ri not in gone}
        plan = plan.with_actions(actions, kept)
        notes = {
            rep.sample: grid_note(rep, items, item_row, rows, spec) for rep in report.mismatched
        }
        for s, why in failed.items():
            notes[s] = "; ".join(filter(None, (notes.get(s), f"repair failed, {why}")))
        for s, why in plan.reasons:
            notes[s] = "; ".join(filter(None, (why, notes.get(s))))
        records = plan_call_records(report, plan, items, notes, step, mb)
        if gen is not None and cfg.generated == "text":
            kept = {s for s, a in enumerate(plan.actions) if a in ("keep", "repair")}
            records += [
                replace(rec, extra={**rec.extra, "adapter": "qwen_vl"})
                for rec in text_records(gen, step, mb, spec.text_id, kept)
            ]
        stage = conclude(
            guard,
            plan,
            records,
            step=step,
            microbatch=mb,
            mismatched=len(report.mismatched),
            summary=batch_summary(report),
            fatal=bool(report.orphans) and cfg.policy == "raise",
            caller=CALLER,
            bundle=lambda: self._dump(ids, cu, items, report, plan, step, mb),
            digest=self._digest(check, plan),
        )
        rw = rewrite(
            call,
            spec,
            lay,
            ids,
            rows,
            gone,
            repairs,
            plan.actions,
            cfg.ignore_index,
            self.loss_mask_inplace,
            strays=bool(report.stray_findings),
            row_sample=None
            if meta is None or meta[0].sample is None
            else [it.sample for it in meta],
        )
        self._result(plan, report, check, stage, step, mb, rw.input_ids, cu, rw)
        if all(a == "drop" for a in plan.actions):
            self.keeper.every_sample_dropped()
        return call.rebuild()

    def _dump(self, ids, cu, items, report, plan, step, mb):
        if report.ok and plan.keeps_all:
            return None
        return save_replay(
            self.guard,
            input_ids=ids,
            items=items,
            cu_seqlens=cu,
            step=step,
            microbatch=mb,
            report=report,
        )

    def _result(self, plan, report, check, stage, step, mb, ids, cu, rw) -> None:
        verdict = Verdict(check.runs, check.bad, check.findings, 0, check.fingerprint)
        rep = GuardReport.of(
            plan,
            report,
            verdict,
            stage,
            step=step,
            microbatch=mb,
            rank=self.guard.rank.rank,
            num_items=check.runs if report is None else report.num_items,
        )
        lm = rw.loss_mask if rw is not None else None
        lab = rw.labels if rw is not None else None
        self.record(MergeResult(None, lm, lab, rep), ids, cu)


def install_handle(
    model: Any,
    guard: MediaGuard,
    *,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    auto_step_end: bool | None = None,
    drop_token_id: int | None = None,
    loss_mask_inplace: bool = False,
) -> QwenVLHandle:
    """The Qwen-VL family's installer (``install_vlm``'s table; the public name is
    :func:`~..vlm_install.install_qwen_vl`, whose docstring says what each option does)."""
    if not isinstance(model, torch.nn.Module):
        raise MediaInputError(f"install_qwen_vl takes an nn.Module, got {type(model).__name__}")
    spec = spec_from_model(model, drop_token_id)
    spec.check_grammar(guard.grammar)
    _check_geometry(guard.geometry, spec)
    h = QwenVLHandle(
        model,
        guard,
        spec,
        items_provider=items_provider,
        step_provider=step_provider,
        auto_step_end=auto_step_end,
        loss_mask_inplace=loss_mask_inplace,
    )
    return h.install_hooks()


def _feeds_tower(call: CallArgs) -> bool:
    return any(call.get(PIXELS[m]) is not None for m in MODALITIES)


def _check_geometry(geo: Any, spec: QwenVLSpec) -> None:
    geos = geo.items() if isinstance(geo, dict) else [("*", geo)]
    for name, g in geos:
        if name not in ("*", *MODALITIES):
            raise MediaInputError(f"geometry keys are 'image' / 'video', got {name!r}")
        if g is None:
            continue
        for attr in ("patch", "merge", "temporal_patch"):
            want = getattr(spec, attr)
            have = getattr(g, attr, want)
            if have != want:
                raise MediaInputError(
                    f"the guard's {name} geometry has {attr}={have}, the model's config {want}"
                )
