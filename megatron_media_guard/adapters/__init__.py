"""Adapters that guard the merge inside Megatron models, per instance and reversibly.

``handle = install_llava(model, guard)`` / ``install_mimo(model, guard)`` /
``install_generic(model, "merge_embeddings", guard)`` / ``install_qwen_vl(model, guard)`` (a
forward pre-hook on a transformers or Megatron-Bridge Qwen-VL model, docs/QWEN_VL.md); ``handle.remove()`` restores the
instance exactly. ``launcher`` wires them into a Megatron-LM launcher
(``add_media_guard_args`` for ``extra_args_provider``, ``install_from_args``). See
docs/MEGATRON.md.

The integration side: may import everything else in the package, torch.distributed and
megatron-core (lazily, where a release may be absent). A new model family's adapter goes
here as one module (``<family>.py``, checks in ``<family>_checks.py`` when they grow).
"""

from .generic import ArgMap, guard_merge_fn, infer_items, install_generic
from .hooks import GuardHandle, HandleGroup, guarded_by
from .llava.checks import LlavaFault
from .llava.install import LlavaHandle, LlavaResult, install_llava
from .mimo import install_mimo
from .qwen_vl.install import QwenVLHandle, install_qwen_vl

__all__ = [
    "ArgMap",
    "GuardHandle",
    "HandleGroup",
    "LlavaFault",
    "LlavaHandle",
    "LlavaResult",
    "QwenVLHandle",
    "guard_merge_fn",
    "guarded_by",
    "infer_items",
    "install_generic",
    "install_llava",
    "install_mimo",
    "install_qwen_vl",
]
