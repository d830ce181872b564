"""``install_vlm``: one engine for every model family the registry knows (``families/``).

A family is a :class:`~megatron_media_guard.families.spec.FamilySpec`; this module is the
only code that runs it. For ``apply="embed"`` families the guard is a forward pre-hook on the
model instance that

1. encodes each modality the call carries through the model's *own* feature method (the
   tower runs where the model would run it: before the decoder, once, on every rank);
2. puts the items in token order (one stream per placeholder token; streams that share a
   token, Nemotron's images and video tubelets, are interleaved by length on the host);
3. merges them with :meth:`MediaGuard.merge` (per-run check, plan, repair / drop / raise,
   records, bundle, consensus: the one fault path) into the model's own token embeddings;
4. lets the model's forward run on ``inputs_embeds`` with the media inputs taken out, and the
   labels of dropped samples ignored.

``apply="qwen_vl"`` families (positions follow their grid rows) are handed to
:func:`~megatron_media_guard.adapters.qwen_vl.install.install_qwen_vl`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..config import GuardConfig
from ..core.grammar import Grammar
from ..core.guard import MediaGuard
from ..core.interleave import interleave
from ..core.items import MediaItem
from ..core.outcome import MergeResult
from ..core.runs import TokenLayout, parse_layout
from ..errors import MediaInputError
from ..families import FAMILIES, FamilySpec, find_family, unwrap
from ..families.spec import Encoded, ModalitySpec, present
from .hooks import GuardHandle, ItemsProvider, StepProvider
from .qwen_vl.checks import CallArgs
from .qwen_vl.rewrite import add_anchor

MARK = "_media_guard_vlm"
PIXELS_FLAG = "_media_guard_pixels"  # tells a spec's encode to cut per-item pixels (repair)


class VLMHandle(GuardHandle):
    """The installed pre-hook (and post-forward hook) of one family model instance.

    ``last_result``: a :class:`MergeResult` (``embeddings`` None) of the last guarded call;
    ``mask_loss(loss_mask, labels)`` applies its drops. ``set_items``: one :class:`MediaItem`
    per model-level item (images, then videos, then audio clips, each in the order the model
    consumes them) adding ``sample``, ``sample_id`` and ``source_hw``; a video's tubelets
    inherit its item's fields.
    """

    def __init__(self, model: Any, guard: MediaGuard, spec: FamilySpec, **kw: Any) -> None:
        super().__init__(model, "forward", guard, "vlm", **kw)
        self.spec = spec
        self.sig = inspect.signature(model.forward)
        self._hooks: list[Any] = []
        self._all_dropped = False

    @property
    def installed(self) -> bool:
        return bool(self._hooks)

    def install_hooks(self) -> VLMHandle:
        m = self.module
        if m.__dict__.get(MARK) is not None:
            raise MediaInputError(
                f"this {type(m).__name__} is already guarded (by a vlm handle); call "
                "handle.remove() before installing again"
            )
        self._hooks = [
            m.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            m.register_forward_hook(self._post_hook, with_kwargs=True),
        ]
        object.__setattr__(m, MARK, self)
        return self

    def remove(self) -> None:
        """Takes both hooks off: the model is the plain model again (idempotent)."""
        for h in self._hooks:
            h.remove()
        if self._hooks:
            self.module.__dict__.pop(MARK, None)
        self._hooks = []

    # ---- hooks ------------------------------------------------------------------------

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict):
        self._all_dropped = False
        try:
            call = CallArgs(self.sig, args, kwargs)
        except TypeError:
            return None  # the model reports its own signature error
        ids = call.get("input_ids")
        if not isinstance(ids, torch.Tensor) or call.get("inputs_embeds") is not None:
            return None  # no token ids to check (or the caller merged already)
        if call.get("mm_encoder_outputs") is not None:
            return None  # encoded before the forward (transformers' generate)
        kw = {n: call.get(n) for m in self.spec.modalities for n in m.inputs}
        mods = present(self.spec, kw)
        if not mods:
            return None  # text-only: nothing to check
        label = f"{self.spec.name} media guard"
        return self.call(label, lambda step, mb: self._run(call, ids, kw, mods, step, mb))

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        if not self._all_dropped:
            return None
        self._all_dropped = False
        return add_anchor(out, None, True)  # a loss over no label: a finite zero

    # ---- one call -----------------------------------------------------------------------

    def _run(self, call: CallArgs, ids: torch.Tensor, kw: dict, mods, step, mb):
        guard, spec, model = self.guard, self.spec, self.module
        if guard.config.policy == "repair":
            kw = {**kw, PIXELS_FLAG: True}
        encoded = {m.name: m.encode(model, kw) for m in mods}
        meta = self.take_items()
        items, feats, listed = _items(mods, encoded, meta)
        parent = _parents(mods, encoded)
        order = listed if listed is not None else _token_order(ids, guard, mods, items, parent)
        items = [items[i] for i in order]
        feats = [feats[i] for i in order]
        emb = model.get_input_embeddings()(ids)
        labels = call.get("labels")
        res = guard.merge(
            emb,
            ids,
            feats,
            items,
            labels=labels if isinstance(labels, torch.Tensor) else None,
            step=step,
            microbatch=mb,
            encoder=_repair_encoder(model, mods),
        )
        self.record(MergeResult(None, res.loss_mask, res.labels, res.report), ids, None)
        call.set("inputs_embeds", res.embeddings)
        for m in spec.modalities:
            for name in m.inputs:
                if call.given(name):
                    call.set(name, None)
        if isinstance(labels, torch.Tensor):
            call.set("labels", res.labels)
        self._all_dropped = bool(res.report.dropped) and len(res.report.dropped) == len(
            res.report.actions
        )
        _evs(model, call, ids, encoded, items, res)
        return call.rebuild()


def _items(
    mods: Sequence[ModalitySpec], encoded: dict[str, Encoded], meta: Sequence[MediaItem] | None
) -> tuple[list[MediaItem], list[torch.Tensor], list[int] | None]:
    """MediaItems and features in the model's consumption order (modality by modality), and,
    when ``set_items`` gave metadata, the items' order as listed there (taken as token order).

    ``meta``: one item per model-level item (a video, not its tubelets); the k-th item of a
    modality in the list describes the model's k-th item of that modality.
    """
    items: list[MediaItem] = []
    feats: list[torch.Tensor] = []
    first: dict[str, list[int]] = {}  # modality -> per model-level item, its first item index
    for m in mods:
        enc = encoded[m.name]
        parents = enc.parent or tuple(range(len(enc.features)))
        starts = first.setdefault(m.name, [])
        for k, f in enumerate(enc.features):
            if parents[k] == len(starts):
                starts.append(len(items))
            items.append(
                MediaItem(
                    int(f.shape[0]),
                    modality=m.name,
                    num_frames=enc.num_frames[k] if enc.num_frames else None,
                    frame_hw=enc.frame_hw[k] if enc.frame_hw else None,
                    pixels=enc.pixels[k] if enc.pixels else None,
                )
            )
            feats.append(f)
    if meta is None:
        return items, feats, None
    want = {m: len(v) for m, v in first.items()}
    got: dict[str, int] = {}
    for g, src in enumerate(meta):
        if src.modality not in want:
            raise MediaInputError(
                f"set_items: item {g} has modality {src.modality!r}; this call holds "
                f"{ {m: n for m, n in want.items()} } model-level items"
            )
        got[src.modality] = got.get(src.modality, 0) + 1
    if got != want:
        raise MediaInputError(
            f"set_items gave {len(meta)} items {got} for this call's {want} (one per image, "
            "video and audio clip)"
        )
    order: list[int] = []
    rank: dict[str, int] = {}
    for src in meta:
        k = rank.get(src.modality, 0)
        rank[src.modality] = k + 1
        lo = first[src.modality][k]
        nxt = first[src.modality][k + 1] if k + 1 < len(first[src.modality]) else None
        hi = nxt if nxt is not None else _end_of(items, lo, src.modality)
        for i in range(lo, hi):
            items[i] = replace(
                items[i], sample=src.sample, sample_id=src.sample_id, source_hw=src.source_hw
            )
            order.append(i)
    return items, feats, order


def _parents(mods: Sequence[ModalitySpec], encoded: dict[str, Encoded]) -> list[int]:
    """Per item (consumption order), the model-level item it belongs to (a video's tubelets
    share one), numbered per modality."""
    out: list[int] = []
    for m in mods:
        enc = encoded[m.name]
        out += list(enc.parent or range(len(enc.features)))
    return out


def _end_of(items: list[MediaItem], lo: int, modality: str) -> int:
    hi = lo
    while hi < len(items) and items[hi].modality == modality:
        hi += 1
    return hi


def _token_order(
    ids, guard: MediaGuard, mods, items: list[MediaItem], parent: list[int]
) -> list[int]:
    """The items' permutation into token order. One modality: as consumed. Several: the runs'
    order read from the ids (a transfer sized by the runs; mixed batches only); a run whose
    token several modalities share takes the item the length interleaving gives it (when
    only one interleaving fits; else :class:`MediaInputError` asks for ``set_items``)."""
    if len(mods) == 1:
        return list(range(len(items)))
    g = guard.grammar
    parsed = parse_layout(TokenLayout(ids, g))
    streams: dict[str, dict[str, list[int]]] = {}  # token modality -> modality -> item indices
    for i, it in enumerate(items):
        tok = g.token_modality(it.modality)
        streams.setdefault(tok, {}).setdefault(it.modality, []).append(i)
    runs_of: dict[str, list[int]] = {}
    samples_of: dict[str, list[int]] = {}
    for r in parsed.runs:
        runs_of.setdefault(r.modality, []).append(r.length)
        samples_of.setdefault(r.modality, []).append(r.sample)
    queue: dict[str, list[int]] = {}
    for tok, by_mod in streams.items():
        seqs = list(by_mod.values())
        if len(seqs) == 1:
            queue[tok] = seqs[0]
            continue
        if len(seqs) > 2:
            raise MediaInputError(f"more than two modalities share the {tok!r} token")
        a, b = seqs
        la = [items[i].num_features for i in a]
        lb = [items[i].num_features for i in b]
        pick, unique = interleave(
            runs_of.get(tok, []),
            la,
            lb,
            groups=[parent[i] for i in b],
            run_samples=samples_of.get(tok, []),
        )
        if pick is None:  # no interleaving fits: consumption order, the guard reports it
            queue[tok] = a + b
            continue
        if not unique:  # equal lengths at a choice: the ids cannot tell, and a guess is silent
            raise MediaInputError(
                f"{' and '.join(by_mod)} runs share the {tok!r} token and have equal lengths "
                "where their order is open: the ids cannot tell which is which. Give "
                "handle.set_items(...) with one MediaItem per item in token order"
            )
        ia, ib = iter(a), iter(b)
        queue[tok] = [next(ia) if s == 0 else next(ib) for s in pick]
    order: list[int] = []
    for r in parsed.runs:
        q = queue.get(r.modality)
        if q:
            order.append(q.pop(0))
    order += [i for q in queue.values() for i in q]  # items beyond the runs: the guard reports
    return order


def _repair_encoder(model: Any, mods: Sequence[ModalitySpec]):
    m = next((m for m in mods if m.reencode is not None), None)
    if m is None:
        return None
    return lambda pixels, **_: m.reencode(model, pixels)


def _evs(model, call: CallArgs, ids, encoded, items, res) -> None:
    """Nemotron's efficient video sampling (``video_pruning_rate > 0``): prune the video
    tokens after the merge as the model does, with the model's own retention function."""
    rate = float(getattr(model, "video_pruning_rate", 0) or 0)
    enc = encoded.get("video")
    if rate <= 0 or enc is None:
        return
    fn = getattr(sys.modules[type(model).__module__], "compute_retention_mask", None)
    if fn is None:
        raise MediaInputError("video_pruning_rate > 0 but the model's module has no EVS function")
    raise MediaInputError(
        "video_pruning_rate > 0 (EVS) is not supported by the guard yet: set it to 0 for "
        "guarded training"
    )


def family_grammar(spec: FamilySpec, model: Any, tokenizer: Any = None) -> Grammar:
    """The grammar of ``spec`` with ``model``'s own token ids."""
    return _GRAMMARS[spec.apply](spec, model, tokenizer)


def _embed_grammar(spec: FamilySpec, model: Any, tokenizer: Any) -> Grammar:
    return spec.grammar(model, tokenizer)


def _qwen_grammar(spec: FamilySpec, model: Any, tokenizer: Any) -> Grammar:
    from .qwen_vl.checks import spec_from_model

    return spec_from_model(model).grammar()


def _llava_grammar(spec: FamilySpec, model: Any, tokenizer: Any) -> Grammar:
    from .llava.checks import llava_grammar

    tok = getattr(model, "image_token_index", None)
    return llava_grammar(-200 if tok is None else tok)


def _mimo_grammar(spec: FamilySpec, model: Any, tokenizer: Any) -> Grammar:
    from .mimo import mimo_grammar

    return mimo_grammar(getattr(model, "special_token_ids", None) or {})


_GRAMMARS = {
    "embed": _embed_grammar,
    "qwen_vl": _qwen_grammar,
    "llava": _llava_grammar,
    "mimo": _mimo_grammar,
}


def guard_for(
    spec: FamilySpec,
    model: Any,
    config: GuardConfig | None = None,
    tokenizer: Any = None,
    **guard_kw: Any,
) -> MediaGuard:
    """A :class:`MediaGuard` for ``model`` of family ``spec``: its grammar, and its repair
    geometry when the spec has one (``guard_kw``: ``rank=``, ``consensus=``, ``grammar=``)."""
    grammar = guard_kw.pop("grammar", None) or family_grammar(spec, model, tokenizer)
    if "geometry" not in guard_kw and spec.geometry is not None:
        guard_kw["geometry"] = spec.geometry(model)
    return MediaGuard(config, grammar, **guard_kw)


def _check_guard(spec: FamilySpec, model: Any, guard: MediaGuard, tokenizer: Any) -> None:
    if spec.apply != "embed":
        return  # the megatron-core and Qwen-VL installers check their grammar themselves
    have = dict(guard.grammar.placeholders)
    want = {
        m.name: m.placeholder.resolve(model, tokenizer) for m in spec.modalities if not m.shares
    }
    if any(have.get(k) != v for k, v in want.items() if v is not None) or set(have) - set(want):
        raise MediaInputError(
            f"the guard's grammar placeholders {have} differ from the {spec.name} model's "
            f"{want}: build the guard with the family's grammar (FamilySpec.grammar)"
        )


def _install_embed(model, guard, spec, **kw) -> GuardHandle:
    return VLMHandle(model, guard, spec, **kw).install_hooks()


def _install_qwen(model, guard, spec, **kw) -> GuardHandle:
    from .qwen_vl.install import install_qwen_vl

    return install_qwen_vl(model, guard, **kw)


def _install_llava(model, guard, spec, **kw) -> GuardHandle:
    from .llava.install import install_llava

    kw.pop("loss_mask_inplace", None)  # LLaVA returns its masks from the merge
    return install_llava(model, guard, **kw)


def _install_mimo(model, guard, spec, **kw) -> GuardHandle:
    from .mimo import install_mimo

    kw.pop("loss_mask_inplace", None)
    return install_mimo(model, guard, **kw)


#: how each kind of family is installed (FamilySpec.apply -> installer)
INSTALLERS = {
    "embed": _install_embed,
    "qwen_vl": _install_qwen,
    "llava": _install_llava,
    "mimo": _install_mimo,
}


def install_vlm(
    model: Any,
    config_or_guard: GuardConfig | MediaGuard | None = None,
    tokenizer: Any = None,
    *,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    auto_step_end: bool | None = None,
    **install_kw: Any,
) -> GuardHandle:
    """Guard one model instance of any family the registry knows (``families.FAMILIES``).

    config_or_guard: a :class:`GuardConfig` (or None: the defaults) builds the guard from the
    family (grammar from the model's config and ``tokenizer``, repair geometry from the spec);
    a :class:`MediaGuard` is used as given (its grammar must be the family's). Wrappers (DDP's
    ``.module``, Megatron-Bridge's ``.llava_model``) and submodules are looked through. An
    unknown model raises, listing the families known. tokenizer: anything with
    ``convert_tokens_to_ids``, or a ``{token text: id}`` mapping, for markers the config lacks.
    install_kw: passed to the family's installer (``loss_mask_inplace=`` for Qwen-VL).
    """
    target, spec = find_family(model)
    if spec is None:
        known = ", ".join(
            s.name
            + (
                f" ({', '.join(sorted(c for v in s.classes.values() for c in v))})"
                if s.classes
                else ""
            )
            for s in FAMILIES
        )
        raise MediaInputError(
            f"install_vlm: no family knows {type(model).__name__}; known: {known}"
        )
    if isinstance(config_or_guard, MediaGuard):
        guard = config_or_guard
        _check_guard(spec, target, guard, tokenizer)
    else:
        guard = guard_for(spec, target, config_or_guard, tokenizer)
    common = dict(
        items_provider=items_provider, step_provider=step_provider, auto_step_end=auto_step_end
    )
    return INSTALLERS[spec.apply](target, guard, spec, **common, **install_kw)


__all__ = ["INSTALLERS", "VLMHandle", "family_grammar", "guard_for", "install_vlm", "unwrap"]
