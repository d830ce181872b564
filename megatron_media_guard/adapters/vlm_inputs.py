"""The family engine's ``apply="inputs"`` mode (docs/FAMILIES.md, docs/QWEN_VL.md): forwards
whose model encodes and merges its media itself; the guard checks the inputs against count
tables on the device (the aligned call's one transfer, the call untouched) and on the fault
path plans the items and applies the plan by rewriting the inputs; it runs no tower but the
spec's ``dummy`` (``adapters/tower.py``)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.guard import MediaGuard
from ..core.runs import TokenLayout
from ..errors import MediaInputError
from ..families import FamilySpec
from ..families.inputs import (
    count_tables,
    counted,
    generated_as_text,
    on_device,
    plan_items,
    token_types,
    verified,
)
from ..families.inputs_items import check_declared, in_order, meta_tables, split_items, token_items
from ..families.resize import Resizer
from ..families.spec import present
from .forward_hook import CallArgs, ForwardHookHandle


class InputsHandle(ForwardHookHandle):
    """The installed pre-hook of one ``apply="inputs"`` model instance (a ``set_items`` item:
    a grid row)."""

    def __init__(
        self,
        model: Any,
        guard: MediaGuard,
        spec: FamilySpec,
        text_id: int,
        *,
        loss_mask_inplace: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(model, guard, spec, text_id, **kw)
        self.loss_mask_inplace = loss_mask_inplace
        # the repair geometry: the guard's, else the one the model's config gives
        geo = guard.geometry
        if geo is None and spec.geometry is not None and any(m.patches for m in spec.modalities):
            geo = spec.geometry(model)
        self.geometry = geo

    def _guarded(self, call: CallArgs):
        ids = call.get("input_ids")
        had = self._feeds(call)
        new = None
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:  # inputs_embeds only: no ids
            view = call.view(ids)
            mods = present(self.spec, view)  # none (text only): planned all the same
            new = self.call(self.label, lambda step, mb: self._run(call, ids, view, mods, step, mb))
        if had or call.get("past_key_values") is None:  # not in a decoding step
            self.keep_tower(had_media=had, feeds_media=self._feeds(call))
        return new

    def _feeds(self, call: CallArgs) -> bool:
        return any(call.get(m.inputs[0]) is not None for m in self.spec.modalities)

    # ---- one call -----------------------------------------------------------------------

    def _run(self, call: CallArgs, ids: torch.Tensor, view: dict, mods, step, mb):
        guard, spec = self.guard, self.spec
        config = getattr(self.module, "config", None)
        cu = packed_offsets(call, ids)
        lay = TokenLayout(ids, guard.grammar, cu)
        meta = self.take_items()
        labels, lmask = call.tensor("labels"), call.tensor("loss_mask")
        for m in mods:
            for name, grid in m.patches.items():
                if view.get(name) is not None and view.get(grid) is None:
                    raise MediaInputError(f"{name} given without {grid}")
        tables = count_tables(spec, mods, config, view)
        rows = patch_rows_bad(view, mods)
        types = self._types(call, ids)
        ok, samples, declared = meta_tables(meta, mods, tables, lay.num_samples)
        if on_device(spec, device=ids.device) and ok:
            # the runs against the tables on the device: the verdict (with the inputs' own
            # checks) is the aligned call's one transfer
            extra = [x for x in (rows, types) if x is not None]
            kw = dict(labels=labels, loss_mask=lmask, step=step, microbatch=mb)
            kw["gate"] = int(rows is not None)  # bad pixel rows keep no sample
            kw["types"] = token_types(spec, view)
            res, got = verified(guard, lay, mods, tables, samples, declared, extra, **kw)
            rows_bad = got.pop(0) if rows is not None else 0
            types_bad = got.pop(0) if types is not None else 0
            if rows_bad:
                raise MediaInputError(
                    "pixel rows disagree with the grids (the patch rows must hold "
                    f"sum(t*h*w) per modality: {', '.join(n for m in mods for n in m.patches)})"
                )
            if types_bad:  # the ids are the truth: the token types / masks follow them
                given = sorted(n for n in spec.follow_ids if isinstance(view.get(n), torch.Tensor))
                why = f"{types_bad} positions of {given} disagree with input_ids: rebuilt from the ids"
                self.note(step, mb, "rebuilt", why)
            if res is not None:
                self.record(res, ids, cu)
                if not types_bad:
                    return None  # the call as given: the model's own forward, bit for bit
                self._follow(call, ids)
                return call.rebuild()
        return self._diagnose(call, ids, view, mods, tables, meta, lay, cu, labels, lmask, step, mb)

    def _diagnose(self, call, ids, view, mods, tables, meta, lay, cu, labels, lmask, step, mb):
        guard, spec = self.guard, self.spec
        encoded = counted(spec, mods, tables)
        explicit = meta is not None and all(it.sample is not None for it in meta)
        # tied to their samples: token_order takes them per sample, else in set_items' order
        types = token_types(spec, view)
        items, parent = token_items(
            ids, guard.grammar, mods, encoded, meta, types, listed=not explicit
        )
        check_declared(meta, mods, encoded)
        if explicit and not in_order(meta):
            why = "items out of token order (set_items samples decrease): their rows are "
            self.note(step, mb, "reordered", why + "fed in sample order")
        items, split = split_items(lay, items, parent)
        for (mod, k), why in split.items():  # never kept or repaired: its samples mismatch
            grid = next(
                (it.grid_thw for it, p in zip(items, parent) if (it.modality, p) == (mod, k)), None
            )
            self.note(step, mb, "split", f"{mod} {k} grid {grid}: {why}")
        rep = None
        if self.geometry is not None and any(m.patches for m in mods):
            rep = Resizer(mods, items, parent, view, self.geometry, split)
        kw = dict(labels=labels, loss_mask=lmask, step=step, microbatch=mb, cu_seqlens=cu)
        res, gone = plan_items(guard, ids, items, parent, encoder=rep, **kw)
        self.record(res, ids, cu)
        report = res.report
        new_ids = generated_as_text(report, ids, self.text_id, guard.config.generated)[0]
        dropped = set(report.dropped)
        fixed = rep.kept(report) if rep is not None else {}
        smp_order = None  # per modality each item's sample: fed in sample order
        if explicit and not in_order(meta):
            smp_order = {m.name: [it.sample for it in meta if it.modality == m.name] for m in mods}
        strays = lay.packed and bool(report.alignment and report.alignment.stray_findings)
        if not (dropped or gone or fixed or smp_order or strays) and new_ids is ids:
            self._follow(call, ids)  # the ids are the truth: given token types follow them
            return call.rebuild() if call.changed else None  # else the model's own forward
        given = {**view, "input_ids": new_ids}
        out = self.rewrite(call, given, mods, dropped, gone, cu=cu, repaired=fixed, order=smp_order)
        if labels is not None and res.labels is not None:
            call.set("labels", res.labels)
        if lmask is not None and dropped:
            if self.loss_mask_inplace:
                lmask.copy_(res.loss_mask)
            else:
                call.set("loss_mask", res.loss_mask.to(lmask.dtype))
        self._follow(call, out["input_ids"])
        self.keeper.planned(res.report.actions)
        return call.rebuild()

    # ---- the inputs' own checks and rebuilds ------------------------------------------

    def _derived(self, call: CallArgs, ids: torch.Tensor) -> dict:
        """Per given per-token input (``follow_ids``), ``(given, what the ids say it must be)``
        (the spec's ``derive``, on its device and in its dtype)."""
        derive, out = self.spec.derive, {}
        for name in self.spec.follow_ids if derive is not None else ():
            given = call.get(name)
            if isinstance(given, torch.Tensor):
                want = derive(name, ids.to(given.device), self.guard.grammar)
                out[name] = given, want.to(given.dtype)
        return out

    def _types(self, call: CallArgs, ids: torch.Tensor) -> torch.Tensor | None:
        """Device scalar: positions where the given per-token inputs disagree with the ids."""
        pairs = self._derived(call, ids).values()
        return sum(torch.count_nonzero(g != w) for g, w in pairs) if pairs else None

    def _follow(self, call: CallArgs, ids: torch.Tensor) -> None:
        """The given per-token inputs rebuilt from ``ids``, and ``position_ids`` left to the
        model once the media inputs changed (they follow the grids; ``mm_token_type_ids``
        derived where the forward takes it and none was given)."""
        if self.spec.derive is None:
            return
        media_changed = call.changed
        for name, (_, want) in self._derived(call, ids).items():
            call.set(name, want)
        if media_changed and call.get("position_ids") is not None:
            call.set("position_ids", None)
            for name in self.spec.follow_ids:
                if name in call.names and call.get(name) is None:
                    call.set(name, self.spec.derive(name, ids, self.guard.grammar))
                    break


def packed_offsets(call: CallArgs, ids: torch.Tensor) -> torch.Tensor | None:
    """Sample offsets of a packed THD row: Megatron's ``packed_seq_params``
    (``cu_seqlens_q_padded`` where set, else ``cu_seqlens_q``) or transformers'
    ``cu_seq_lens_q``. None for ``[b, s]`` rows (each row one sample)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        return None
    psp = call.get("packed_seq_params")
    cu = None
    if psp is not None and getattr(psp, "qkv_format", "thd") in (None, "thd"):
        cu = getattr(psp, "cu_seqlens_q_padded", None)
        if cu is None:
            cu = getattr(psp, "cu_seqlens_q", None)
    if cu is None:
        cu = call.get("cu_seq_lens_q")
    return None if cu is None else cu.to(ids.device)


def patch_rows_bad(view, mods) -> torch.Tensor | None:
    """Device scalar: patch inputs (``ModalitySpec.patches``) whose rows are not the sum of
    their grid rows' ``t*h*w`` (read with the verdict; None when the call has none)."""
    bad = None
    for m in mods:
        for name, grid in m.patches.items():
            x, g = view.get(name), view.get(grid)
            if isinstance(x, torch.Tensor) and isinstance(g, torch.Tensor):
                b = (g.long().prod(-1).sum() != x.shape[0]).long()
                bad = b if bad is None else bad + b
    return bad


__all__ = ["InputsHandle", "packed_offsets", "patch_rows_bad"]
