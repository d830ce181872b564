"""megatron-core's merges: ``LLaVAModel._preprocess_data`` (collapsed ``<image>`` tokens expanded
to tiles x img_seq_len, Nemotron VL / Omni through Megatron-Bridge's ``.llava_model``) and
``MimoModel.align_embeddings_by_token_positions``. Their adapters wrap the merge method itself
(``adapters/llava``, ``adapters/mimo.py``); these specs only say how the registry finds them.
Nothing is imported: a class already loaded is checked with isinstance, else by its methods.
"""

from __future__ import annotations

import sys
from typing import Any

from .spec import FamilySpec


def _is_llava(m: Any) -> bool:
    mod = sys.modules.get("megatron.core.models.multimodal.llava_model")
    if mod is not None and isinstance(m, mod.LLaVAModel):
        return True
    return callable(getattr(type(m), "_preprocess_data", None)) and hasattr(m, "img_seq_len")


def _is_mimo(m: Any) -> bool:
    mod = sys.modules.get("megatron.core.models.mimo.model.base")
    if mod is not None and isinstance(m, mod.MimoModel):
        return True
    return callable(getattr(type(m), "align_embeddings_by_token_positions", None))


LLAVA = FamilySpec(name="llava", classes={}, modalities=(), apply="llava", detect=_is_llava)
MIMO = FamilySpec(name="mimo", classes={}, modalities=(), apply="mimo", detect=_is_mimo)
