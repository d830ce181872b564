"""Model families as data: one :class:`~.spec.FamilySpec` per family on one engine
(``adapters/vlm.py``); ``FAMILIES`` is the registry ``install_vlm`` searches. A new family is a
module here with a ``SPEC`` and one line below (docs/FAMILIES.md).
"""

from __future__ import annotations

import textwrap
from itertools import chain
from typing import Any

from ..errors import MediaInputError
from . import (
    ernie4_5_vl,
    gemma3,
    glm4v,
    internvl,
    kimi_k25,
    llava_onevision,
    megatron,
    mistral3,
    nemotron_omni,
    qwen,
    qwen2_audio,
    qwen3_omni,
    qwen3_omni_bridge,
)
from .derived import derive
from .spec import FamilySpec, ModalitySpec, Token

FAMILIES: tuple[FamilySpec, ...] = (
    megatron.LLAVA,
    megatron.MIMO,
    qwen.SPEC,
    nemotron_omni.SPEC,
    gemma3.SPEC,
    gemma3.BRIDGE,
    kimi_k25.SPEC,
    kimi_k25.BRIDGE,
    internvl.SPEC,
    qwen2_audio.SPEC,
    qwen2_audio.BRIDGE,
    qwen3_omni.SPEC,
    qwen3_omni_bridge.SPEC,
    glm4v.SPEC,
    glm4v.BRIDGE,
    ernie4_5_vl.SPEC,
    ernie4_5_vl.BRIDGE,
    mistral3.SPEC,
    mistral3.BRIDGE,
    llava_onevision.SPEC,
)

#: attributes that hold the model a wrapper trains (DDP / FSDP1's ``.module``, Bridge's
#: Nemotron VL / Omni ``.llava_model``), looked through in this order
WRAPPERS = ("module", "llava_model")


def unwrap(model: Any):
    """``model`` and what it wraps, outermost first (bounded: wrappers never loop)."""
    out, cur = [], model
    for _ in range(8):
        if cur is None or any(cur is o for o in out):
            break
        out.append(cur)
        cur = next((getattr(cur, w) for w in WRAPPERS if getattr(cur, w, None) is not None), None)
    return out


def family_of(model: Any) -> FamilySpec | None:
    """The family that knows ``model`` itself (no unwrapping), or None."""
    return next((spec for spec in FAMILIES if spec.matches(model)), None)


def find_family(model: Any) -> tuple[Any, FamilySpec | None]:
    """The (possibly wrapped) model a family knows, and that family (``(model, None)``: none):
    wrappers first, then the submodules, the outermost first; else a spec derived from a
    transformers class (:func:`~.derived.derive`)."""
    modules = getattr(model, "modules", None)
    for m in chain(unwrap(model), modules() if callable(modules) else ()):
        spec = family_of(m)
        if spec is not None:
            return m, spec
    for m in unwrap(model):  # no written spec: one read from the class (families/derived.py)
        spec = derive(m)
        if spec is not None:
            return m, spec
    return model, None


def family_names() -> tuple[str, ...]:
    """Each registered family's name once, in registry order."""
    return tuple(dict.fromkeys(f.name for f in FAMILIES))


def no_family(caller: str, what: str) -> MediaInputError:
    """The refusal of ``what`` (a model, a family name) no family knows, from ``caller``."""
    names = textwrap.fill(
        ", ".join(family_names()), width=88, initial_indent="    ", subsequent_indent="    "
    )
    return MediaInputError(
        f"{caller}: no family knows {what}.\n"
        f"  known families (their classes: docs/FAMILIES.md):\n{names}\n"
        "  another model: guard its merge with install_generic or MediaGuard.merge",
        context={"caller": caller, "families": list(family_names())},
    )


__all__ = [
    "FAMILIES",
    "FamilySpec",
    "ModalitySpec",
    "Token",
    "family_names",
    "family_of",
    "find_family",
    "no_family",
    "unwrap",
]
