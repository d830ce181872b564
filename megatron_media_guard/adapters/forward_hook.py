"""What the family engine's two modes share (``vlm``: ``apply="embed"``, ``vlm_inputs``:
``apply="inputs"``): the guard as a pre and a post around one model instance's ``forward`` (the
one hook type, :class:`~.method_hook.Hook`), the tower keeper between the two, and
:class:`CallArgs`, the keyword view of the call the pre sees."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..core.guard import MediaGuard
from ..diagnostics import GuardRecord
from ..errors import MediaInputError
from ..families import FamilySpec
from ..families.inputs import drop_inputs
from .hooks import GuardHandle
from .tower import TowerKeeper, input_embeddings, tower_due


class CallArgs:
    """The keyword view of one forward call (positional arguments bound by the signature);
    ``set`` writes back, :meth:`rebuild` gives ``(args, kwargs)`` for the model."""

    def __init__(self, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
        self.bound = sig.bind(*args, **kwargs)
        self.varkw = next(
            (p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None
        )
        self.names = {
            p.name
            for p in sig.parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
        self.changed = False

    def get(self, name: str) -> Any:
        a = self.bound.arguments
        return a[name] if name in a else a.get(self.varkw, {}).get(name)

    def tensor(self, name: str) -> torch.Tensor | None:
        """The argument ``name`` where it is a tensor, else None."""
        value = self.get(name)
        return value if isinstance(value, torch.Tensor) else None

    def set(self, name: str, value: Any) -> None:
        self.changed = True
        if name in self.names:
            self.bound.arguments[name] = value
        elif self.varkw:
            self.bound.arguments.setdefault(self.varkw, {})[name] = value
        else:
            raise MediaInputError(f"the model's forward takes no {name!r}")

    def rebuild(self) -> tuple[tuple, dict]:
        return tuple(self.bound.args), dict(self.bound.kwargs)

    def view(self, ids: torch.Tensor) -> dict:
        """The keyword arguments as the model would see them, ``input_ids`` = ``ids``."""
        out = dict(self.bound.arguments)
        out.update(out.pop(self.varkw, None) or {})
        out["input_ids"] = ids
        return out


class ForwardHookHandle(GuardHandle):
    """The guard of one family model instance: a pre and a post around its ``forward``, a
    :class:`~.tower.TowerKeeper` between them. Subclasses define ``_guarded(call)``:
    None (the call as given) or ``(args, kwargs)`` for the model. ``text_id``: what a dropped
    sample's placeholders become.

    ``last_result``: a :class:`MergeResult` (no embeddings) of the last guarded call.
    ``set_items``: one :class:`MediaItem` per model-level item (an image, a video, an audio
    clip; the k-th of a modality describes the model's k-th), adding ``sample``,
    ``sample_id``, ``source_hw`` (and the ``num_features`` it expects).
    """

    def __init__(
        self, model: Any, guard: MediaGuard, spec: FamilySpec, text_id: int, **kw: Any
    ) -> None:
        super().__init__(model, "forward", guard, "vlm", **kw)
        self.spec = spec
        self.text_id = text_id
        self.label = f"{spec.name} media guard"
        self.sig = inspect.signature(model.forward)
        self.keeper = TowerKeeper()

    def install_hooks(self) -> ForwardHookHandle:
        self.install(
            pre=lambda args, kwargs: self._pre_hook(args, kwargs),
            post=lambda args, kwargs, out: self.keeper.attach(out),
        )
        emb = input_embeddings(self.module)
        if emb is not None:
            try:
                self.hook(emb, "forward", post=self.keeper.into_embeddings)
            except MediaInputError:
                self.remove()
                raise
        return self

    def remove(self) -> None:
        super().remove()
        self.keeper.clear()  # a forward that raised may hold the dummy tower call's graph

    def _pre_hook(self, args: tuple, kwargs: dict) -> Any:
        self.keeper.clear()  # a forward that raised leaves nothing behind
        try:
            call = CallArgs(self.sig, args, kwargs)
        except TypeError:
            return None  # the model reports its own signature error
        if call.get("mm_encoder_outputs") is not None:
            return None  # encoded before the forward (transformers' generate)
        return self._guarded(call)

    def keep_tower(self, *, had_media: bool, feeds_media: bool) -> None:
        """The spec's ``dummy`` tower call now, before the model's body, when
        :func:`~.tower.tower_due` (the call feeds the tower nothing)."""
        dummy, mode = self.spec.dummy, self.guard.config.keep_tower
        if dummy is not None and tower_due(mode, had_media=had_media, feeds_media=feeds_media):
            self.keeper.run(lambda: dummy(self.module))

    def rewrite(self, call: CallArgs, given: dict, mods, dropped, gone, **kw: Any) -> dict:
        """The plan applied to the call (:func:`~..families.inputs.drop_inputs`) on ``given``
        (the ids, the tensors that follow them, the kept inputs), each input it changed set on
        ``call``; returns the rewritten inputs."""
        out = drop_inputs(self.spec, given, mods, self.guard, dropped, gone, self.text_id, **kw)
        for name, value in out.items():
            if value is not given.get(name):
                call.set(name, value)
        return out

    def note(self, step, mb, action: str, reason: str, modality: str | None = None) -> None:
        """A ``check`` record: the inputs were put right without touching any sample."""
        rec = GuardRecord(
            event="check", step=step, microbatch=mb, modality=modality, action=action, reason=reason
        )
        self.guard.log.emit(rec)
