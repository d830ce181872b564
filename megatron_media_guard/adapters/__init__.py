"""Adapters that guard the merge inside real model classes, per instance and reversibly:
``install_vlm`` (every family of ``families/``; ``install_qwen_vl`` its name for Qwen-VL),
``install_llava``, ``install_mimo``, ``install_generic``; ``handle.remove()`` restores the
instance exactly. ``launcher`` wires them into Megatron-LM (docs/MEGATRON.md, docs/QWEN_VL.md).
"""

# what the core calls but may not import (core/providers.py): the default consensus and rank,
# the replay-bundle writer; importing these modules registers them for every adapter's guard
from ..ranks import defaults as _process_defaults  # noqa: F401
from ..replay import bundle_save as _bundle_writer  # noqa: F401
from .generic import ArgMap, guard_merge_fn, infer_items, install_generic
from .hooks import GuardHandle, HandleGroup
from .llava.install import LlavaHandle, LlavaResult, install_llava
from .method_hook import guarded_by
from .mimo import install_mimo
from .vlm import VLMHandle
from .vlm_inputs import InputsHandle
from .vlm_install import install_qwen_vl, install_vlm

__all__ = [
    "ArgMap",
    "GuardHandle",
    "HandleGroup",
    "InputsHandle",
    "LlavaHandle",
    "LlavaResult",
    "VLMHandle",
    "guard_merge_fn",
    "guarded_by",
    "infer_items",
    "install_generic",
    "install_llava",
    "install_mimo",
    "install_qwen_vl",
    "install_vlm",
]
