"""``install_vlm``: a model's family from the registry, its guard installed through one
installer table (:data:`INSTALLERS`, also ``install_from_args``'s)."""

from __future__ import annotations

from typing import Any

from ..config import GuardConfig
from ..core.grammar import Grammar
from ..core.guard import MediaGuard
from ..errors import MediaInputError
from ..families import FamilySpec, find_family, no_family
from ..families.spec import check_tokenizer
from .hooks import GuardHandle, ItemsProvider, StepProvider
from .llava.install import install_llava, llava_model_grammar
from .mimo import install_mimo, mimo_grammar
from .vlm import VLMHandle
from .vlm_inputs import InputsHandle


def guard_for(
    spec: FamilySpec,
    model: Any,
    config: GuardConfig | None = None,
    tokenizer: Any = None,
    **guard_kw: Any,
) -> MediaGuard:
    """A :class:`MediaGuard` for ``model`` of family ``spec``: its grammar with the model's own
    token ids, its repair geometry when the spec has one (``guard_kw``: ``rank=``,
    ``consensus=``, ``grammar=``)."""
    grammar = guard_kw.pop("grammar", None)
    if grammar is None:
        own = {"llava": llava_model_grammar, "mimo": mimo_grammar}.get(spec.apply)
        grammar = spec.grammar(model, tokenizer) if own is None else own(model)
    if "geometry" not in guard_kw and spec.geometry is not None:
        guard_kw["geometry"] = spec.geometry(model)
    return MediaGuard(config, grammar, **guard_kw)


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


def _check_grammar(spec: FamilySpec, model: Any, grammar: Grammar, tokenizer: Any) -> None:
    """The guard's grammar against the model's own ids (a merge or an input rewrite on the wrong
    ids feeds the model a batch it cannot take): the placeholders, and for ``apply="inputs"``
    the markers, where the config or the tokenizer names them."""
    have = dict(grammar.placeholders)
    want = {
        m.name: m.placeholder.resolve(model, tokenizer) for m in spec.modalities if not m.shares
    }
    bad = any(have.get(k) != v for k, v in want.items() if v is not None) or set(have) - set(want)
    got, exp = (have, grammar.start_id, grammar.end_id), (want, None, None)
    if spec.apply == "inputs":
        try:
            own = spec.grammar(model, tokenizer)
            exp = (want, own.start_id, own.end_id)
            bad = bad or got[1:] != exp[1:]
        except MediaInputError:
            pass  # the config lacks a marker: the placeholders are all there is to go by
    if bad:
        raise MediaInputError(
            f"the guard's grammar (placeholders, start, end) {got} differs from the {spec.name} "
            f"model's {exp}: build the guard with the family's grammar (FamilySpec.grammar)"
        )


def _install_family(model, guard, spec, tokenizer=None, drop_token_id=None, **kw) -> GuardHandle:
    """The family engine's installer: ``apply="embed"`` (:class:`VLMHandle`) or ``"inputs"``
    (:class:`InputsHandle`, its repair geometry checked against the model's config)."""
    _check_grammar(spec, model, guard.grammar, tokenizer)
    text = _text_id(model, guard, spec, tokenizer, drop_token_id)
    if spec.apply == "embed":
        return VLMHandle(model, guard, spec, text, **kw).install_hooks()
    _check_geometry(spec, model, guard.geometry)
    return InputsHandle(model, guard, spec, text, **kw).install_hooks()


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
    """megatron-core's LLaVA / MIMO installer (no tokenizer; loss masks from the merge)."""

    def run(model, guard, spec, tokenizer=None, loss_mask_inplace=None, **kw) -> GuardHandle:
        return install(model, guard, **kw)

    return run


#: how each kind of family is installed (FamilySpec.apply -> installer)
INSTALLERS = {
    "embed": _install_family,
    "inputs": _install_family,
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
    ``.module``, Megatron-Bridge's ``.llava_model``) and submodules are looked through; an
    unknown model raises, listing the families. tokenizer: anything with
    ``convert_tokens_to_ids``, or a ``{token text: id}`` mapping, for markers the config lacks.
    install_kw: to the family's installer (``drop_token_id=``; ``loss_mask_inplace=`` for
    ``apply="inputs"`` families).
    """
    check_tokenizer(tokenizer, "install_vlm")
    target, spec = find_family(model)
    if spec is None:
        raise no_family("install_vlm", f"{type(model).__name__} (nor a wrapper or submodule of it)")
    if isinstance(config_or_guard, MediaGuard):
        guard = config_or_guard  # its grammar checked by the installer
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
    the family's name (docs/QWEN_VL.md). A guard's ``geometry`` (one, or per modality) repairs,
    else the vision config's. options: :func:`install_vlm`'s; ``drop_token_id`` defaults to the
    config's pad token, else 151643; ``loss_mask_inplace``: also zero the dropped samples in the
    caller's ``loss_mask`` (Megatron-Bridge's ``vlm_step`` / ``qwen3_vl_step``).
    """
    return install_vlm(model, config_or_guard, **options)


__all__ = ["INSTALLERS", "guard_for", "install_qwen_vl", "install_vlm"]
