"""The family engine for ``apply="inputs"`` specs: forwards that take no ``inputs_embeds``
(Megatron-Bridge's ``Qwen3OmniThinkerModel``), so the guard cannot merge for them.

The pre-hook reads the call's keyword arguments and

1. sizes each item from its modality's ``counts`` (grids, masks, lengths: no tower runs, the
   model encodes its media itself), lays the call's ``set_items`` on them and puts them in
   token order (``core.interleave.token_order``, or the family's per-token types);
2. plans through the guard (:meth:`MediaGuard.last_stage`, every planned repair attempted:
   with nothing to re-encode into, a repair falls back with its reason), the fault path of
   :func:`~megatron_media_guard.families.collate.check_batch`;
3. applies the plan by rewriting the inputs (:func:`~..families.inputs.drop_inputs`): a
   dropped sample's placeholders become the family's text token, its items' rows leave the
   spec's ``rows`` / ``patches`` inputs, its labels are ignored and its ``loss_mask`` zeroed
   (out of place, or in the caller's tensor with ``loss_mask_inplace``), so that the model's
   own merge sees a consistent batch. An aligned call is passed on untouched; a text-only
   call is planned the same way (no items: it joins the stage's round as every call does).

Rows are samples: the Bridge forwards this serves refuse packed sequences.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.guard import MediaGuard
from ..core.outcome import MergeResult
from ..families import FamilySpec
from ..families.inputs import counted, drop_inputs, generated_as_text, gone_items, plan_items
from ..families.spec import present
from .forward_hook import CallArgs, ForwardHookHandle
from .vlm import MARK, call_view
from .vlm_items import call_items, parents, typed_order


class InputsHandle(ForwardHookHandle):
    """The installed pre-hook of one ``apply="inputs"`` model instance; the handle API of
    :class:`~.vlm.VLMHandle` (``last_result``: a :class:`MergeResult` without embeddings;
    ``mask_loss``, ``set_items``, ``set_step``, ``remove()``, a context manager)."""

    MARK = MARK

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
        super().__init__(model, guard, "vlm", **kw)
        self.spec = spec
        self.text_id = text_id  # what a dropped sample's placeholders become in input_ids
        self.loss_mask_inplace = loss_mask_inplace

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict):
        try:
            call = CallArgs(self.sig, args, kwargs)
        except TypeError:
            return None  # the model reports its own signature error
        ids = call.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return None
        view = call_view(call, ids)
        mods = present(self.spec, view)  # none (text only): planned all the same (the round)
        label = f"{self.spec.name} media guard"
        return self.call(label, lambda step, mb: self._run(call, ids, view, mods, step, mb))

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return None

    def _run(self, call: CallArgs, ids: torch.Tensor, view: dict, mods, step, mb):
        guard, spec = self.guard, self.spec
        encoded = counted(spec, mods, getattr(self.module, "config", None), view)
        items, _, listed = call_items(mods, encoded, self.take_items())
        parent = parents(mods, encoded)
        if listed is None and spec.token_types:
            listed = typed_order(ids, guard.grammar, mods, items, view.get(spec.token_types))
        labels, lmask = (view.get(n) for n in ("labels", "loss_mask"))
        labels = labels if isinstance(labels, torch.Tensor) else None
        lmask = lmask if isinstance(lmask, torch.Tensor) else None
        kw = dict(labels=labels, loss_mask=lmask, step=step, microbatch=mb)
        res, owner = plan_items(guard, ids, items, parent, listed, **kw)
        self.record(res, ids, None)
        new_ids = self._generated_as_text(res, ids)
        dropped = set(res.report.dropped)
        if not dropped and new_ids is ids:
            return None  # the call as given: the model's own forward, bit for bit
        out = {**view, "input_ids": new_ids}
        if dropped:
            gone = gone_items(res.report, owner)
            out = drop_inputs(spec, out, mods, guard, dropped, gone, self.text_id)
            if labels is not None:
                out["labels"] = res.labels
            if lmask is not None and self.loss_mask_inplace:
                lmask.copy_(res.loss_mask)
            elif lmask is not None:
                out["loss_mask"] = res.loss_mask.to(lmask.dtype)
        for name, value in out.items():
            if value is not view.get(name):
                call.set(name, value)
        return call.rebuild()

    def _generated_as_text(self, res: MergeResult, ids: torch.Tensor) -> torch.Tensor:
        """Placeholders the policy generated in kept samples (``GuardConfig.generated="text"``)
        as the family's text token, so the model's merge does not count them."""
        return generated_as_text(res.report, ids, self.text_id, self.guard.config.generated)[0]


__all__ = ["InputsHandle"]
