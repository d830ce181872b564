"""Adapters that guard the merge inside Megatron models, per instance and reversibly.

``handle = install_llava(model, guard)`` / ``install_mimo(model, guard)`` /
``install_generic(model, "merge_embeddings", guard)``; ``handle.remove()`` restores the
instance exactly. See docs/MEGATRON.md.
"""

from .generic import ArgMap, guard_merge_fn, infer_items, install_generic
from .hooks import GuardHandle, HandleGroup, guarded_by
from .llava import LlavaResult, install_llava
from .llava_checks import ImageFault
from .mimo import install_mimo

__all__ = [
    "ArgMap",
    "GuardHandle",
    "HandleGroup",
    "ImageFault",
    "LlavaResult",
    "guard_merge_fn",
    "guarded_by",
    "infer_items",
    "install_generic",
    "install_llava",
    "install_mimo",
]
