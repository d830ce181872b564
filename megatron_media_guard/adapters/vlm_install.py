"""``install_vlm``: find a model's family in the registry (``families.FAMILIES``) and install
that family's guard through one installer table (``FamilySpec.apply`` -> installer, also
``install_from_args``'s): the family engine (``adapters/vlm.py``) for ``apply="embed"`` specs,
its input rewrite (``adapters/vlm_inputs.py``) for ``apply="inputs"`` specs (the Qwen-VL
family, Bridge's Qwen3-Omni thinker), megatron-core's LLaVA / MIMO merge wrappers."""

from __future__ import annotations

from typing import Any

from ..config import GuardConfig
from ..core.grammar import Grammar
from ..core.guard import MediaGuard
from ..errors import MediaInputError
from ..families import FamilySpec, find_family, no_family
from ..families.spec import check_tokenizer
from .hooks import GuardHandle, ItemsProvider, StepProvider
from .llava.install import install_llava
from .llava.packed import llava_grammar
from .mimo import install_mimo, mimo_grammar
from .vlm import VLMHandle
from .vlm_inputs import InputsHandle


def family_grammar(spec: FamilySpec, model: Any, tokenizer: Any = None) -> Grammar:
    """The grammar of ``spec`` with ``model``'s own token ids (megatron-core's LLaVA: its
    ``image_token_index``, -200 by default; MIMO: its ``special_token_ids``)."""
    if spec.apply == "llava":
        tok = getattr(model, "image_token_index", None)
        return llava_grammar(-200 if tok is None else tok)
    if spec.apply == "mimo":
        return mimo_grammar(getattr(model, "special_token_ids", None) or {})
    return spec.grammar(model, tokenizer)


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
    if spec.apply not in ("embed", "inputs"):
        return  # the megatron-core installers check their grammar themselves
    have = dict(guard.grammar.placeholders)
    want = {
        m.name: m.placeholder.resolve(model, tokenizer) for m in spec.modalities if not m.shares
    }
    if any(have.get(k) != v for k, v in want.items() if v is not None) or set(have) - set(want):
        raise MediaInputError(
            f"the guard's grammar placeholders {have} differ from the {spec.name} model's "
            f"{want}: build the guard with the family's grammar (FamilySpec.grammar)"
        )


def _text_id(model, guard, spec, tokenizer, given: int | None = None) -> int:
    """The text id a dropped sample's placeholders become: ``given`` (``drop_token_id=``),
    else the spec's (the model config's pad token, ...); never a media token."""
    text = spec.text.resolve(model, tokenizer) if given is None else int(given)
    g = guard.grammar
    if text is not None and text in (*g.placeholders.values(), *g.start_ids, *g.end_ids):
        raise MediaInputError(
            f"{spec.name}: drop token id {text} is a media token of the model; pass a text id "
            "(drop_token_id=)"
        )
    if text is None:
        raise MediaInputError(
            f"{spec.name}: no text token id for a dropped sample's placeholders; set the model "
            "config's pad_token_id, pass a tokenizer or drop_token_id="
        )
    return text


def _install_embed(model, guard, spec, tokenizer=None, **kw) -> GuardHandle:
    text = _text_id(model, guard, spec, tokenizer)
    return VLMHandle(model, guard, spec, text, **kw).install_hooks()


def _install_inputs(model, guard, spec, tokenizer=None, drop_token_id=None, **kw) -> GuardHandle:
    _check_markers(spec, model, guard.grammar, tokenizer)
    text = _text_id(model, guard, spec, tokenizer, drop_token_id)
    _check_geometry(spec, model, guard.geometry)
    return InputsHandle(model, guard, spec, text, **kw).install_hooks()


def _check_markers(spec: FamilySpec, model: Any, grammar: Grammar, tokenizer: Any) -> None:
    """The guard's placeholders and markers against the model's own (an input rewrite on the
    wrong ids would feed the model's merge a batch it cannot take)."""
    try:
        want = spec.grammar(model, tokenizer)
    except MediaInputError:
        return  # the config lacks a marker: the guard's grammar is all there is to go by
    got = (dict(grammar.placeholders), grammar.start_id, grammar.end_id)
    exp = (dict(want.placeholders), want.start_id, want.end_id)
    if got != exp:
        raise MediaInputError(
            f"the guard's grammar (placeholders, start, end) {got} differs from the model's "
            f"config {exp}: build the guard with the family's grammar (FamilySpec.grammar)"
        )


def _check_geometry(spec: FamilySpec, model: Any, geo: Any) -> None:
    """A guard's repair geometry against the model's config (patch, merge, temporal patch of
    the spec's own geometry): a resize to the wrong patch grid would feed the tower garbage."""
    if geo is None or spec.geometry is None:
        return
    own = spec.geometry(model)
    names = [m.name for m in spec.modalities]
    geos = geo.items() if isinstance(geo, dict) else [("*", geo)]
    for name, g in geos:
        if name not in ("*", *names):
            raise MediaInputError(f"geometry keys are {names}, got {name!r}")
        want = own.get(name if name != "*" else names[0]) if isinstance(own, dict) else own
        if g is None or want is None:
            continue
        for attr in ("patch", "merge", "temporal_patch"):
            have, need = getattr(g, attr, None), getattr(want, attr, None)
            if have is not None and need is not None and have != need:
                raise MediaInputError(
                    f"the guard's {name} geometry has {attr}={have}, the model's config {need}"
                )


def _megatron(install):
    """megatron-core's LLaVA / MIMO installer, which takes no tokenizer and returns its loss
    masks from the merge (no ``loss_mask_inplace``)."""

    def run(model, guard, spec, tokenizer=None, loss_mask_inplace=None, **kw) -> GuardHandle:
        return install(model, guard, **kw)

    return run


#: how each kind of family is installed (FamilySpec.apply -> installer)
INSTALLERS = {
    "embed": _install_embed,
    "inputs": _install_inputs,
    "llava": _megatron(install_llava),
    "mimo": _megatron(install_mimo),
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
    install_kw: passed to the family's installer (``loss_mask_inplace=`` and
    ``drop_token_id=`` for ``apply="inputs"`` families: the Qwen-VL family, Qwen3-Omni on
    Bridge).
    """
    check_tokenizer(tokenizer, "install_vlm")
    target, spec = find_family(model)
    if spec is None:
        raise no_family("install_vlm", f"{type(model).__name__} (nor a wrapper or submodule of it)")
    if isinstance(config_or_guard, MediaGuard):
        guard = config_or_guard
        _check_guard(spec, target, guard, tokenizer)
    else:
        try:
            guard = guard_for(spec, target, config_or_guard, tokenizer)
        except MediaInputError as err:  # a token the config and the tokenizer lack
            raise err.with_context("install_vlm: ") from None
    common = dict(
        items_provider=items_provider, step_provider=step_provider, auto_step_end=auto_step_end
    )
    return INSTALLERS[spec.apply](target, guard, spec, tokenizer, **common, **install_kw)


def install_qwen_vl(
    model: Any, config_or_guard: GuardConfig | MediaGuard | None = None, **options: Any
) -> GuardHandle:
    """Qwen2-VL / 2.5-VL / 3-VL / 3.5, transformers or Megatron-Bridge: :func:`install_vlm` under
    the family's name (docs/QWEN_VL.md). A guard's grammar must carry the model's token ids
    (``Grammar.qwen2_vl()`` for the default ones), its ``geometry`` (one, or ``{"image": ...,
    "video": ...}``) repairs, else the vision config's (:func:`~..families.qwen.geometry`).
    options: those of :func:`install_vlm`; ``drop_token_id`` defaults to the config's pad
    token, else ``<|endoftext|>`` 151643; ``loss_mask_inplace``: also zero the dropped samples
    in the caller's ``loss_mask`` (Megatron-Bridge's ``vlm_step`` / ``qwen3_vl_step``).
    """
    return install_vlm(model, config_or_guard, **options)


__all__ = ["INSTALLERS", "family_grammar", "guard_for", "install_qwen_vl", "install_vlm"]
