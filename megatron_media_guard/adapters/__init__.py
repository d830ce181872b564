"""Adapters that guard the merge inside real model classes, per instance and reversibly.

``install_llava(model, guard)`` (megatron-core ``LLaVAModel``, 0.16 and 0.19),
``install_qwen_vl(model, guard)`` (transformers and Megatron-Bridge Qwen2.5-VL / Qwen3-VL: the
``apply="inputs"`` engine under the family's name),
``install_mimo(model, guard)`` (megatron-core ``MimoModel``),
``install_vlm(model, config_or_guard, tokenizer)`` (every family of ``families/``) and
``install_generic(model, "merge_embeddings", guard)``; ``handle.remove()`` restores the
instance exactly. ``hooks`` holds the handle every adapter builds on; ``launcher`` wires them
into a Megatron-LM launcher (``add_media_guard_args``, ``install_from_args``). See
docs/MEGATRON.md and docs/QWEN_VL.md.

The integration side: may import everything else in the package, torch.distributed and
megatron-core (lazily, where a release may be absent). A model family with more than one
module gets its own subpackage (``llava/``); a one-module adapter stays a module.
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
