"""FP8 padding of a re-encoded patch sequence (transformer-engine, optional).

TE's FP8 GEMMs need a linear's token dimension a multiple of 8 and its inner dimension of
16; Megatron pads token counts to 16 (32 for MXFP8), newer TE says so through
``get_align_size_for_quantization(recipe)`` (16; 32 MXFP8; 128 NVFP4). A re-projected item
has any patch count, so under FP8 its patches get zero rows at the end and their features
are trimmed off: position-wise layers give the real rows' features first, unchanged; an
encoder attending over the sequence must mask the padding (Qwen2-VL's ``cu_seqlens`` from
``grid_thw`` do). Without TE (CPU CI) FP8 is only on through the configuration flag.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch

from megatron_media_guard.errors import MediaInputError

DEFAULT_FP8_MULTIPLE = 16

# where FP8GlobalStateManager lives (TE >= 2.8: quantization)
_TE_STATE_MODULES = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")


def _te_state_module() -> ModuleType | None:
    """The TE module holding ``FP8GlobalStateManager``, or None (TE absent or unusable)."""
    for name in _TE_STATE_MODULES:
        try:
            module = importlib.import_module(name)
        except (ImportError, OSError, RuntimeError):
            # TE missing, or present but unable to load its CUDA libraries.
            continue
        if hasattr(module, "FP8GlobalStateManager"):
            return module
    return None


def fp8_active(config_flag: bool | None = None) -> bool:
    """Whether the vision encoder runs under FP8: ``config_flag`` when given (Megatron's
    ``config.fp8 is not None``), else whether TE has an ``fp8_autocast`` open now (False
    without TE). Megatron opens it per layer for non-delayed recipes, so detection at the
    merge can miss it: pass the flag when the configuration is known."""
    if config_flag is not None:
        return bool(config_flag)
    module = _te_state_module()
    return module is not None and bool(module.FP8GlobalStateManager.is_fp8_enabled())


def fp8_multiple(config_flag: bool | None = None, multiple: int | None = None) -> int | None:
    """The ``fp8_multiple`` for ``reencode`` (None: FP8 off): ``multiple``, else what the
    active TE recipe needs (module docstring), 16 without TE or an open FP8 context."""
    if not fp8_active(config_flag):
        return None
    if multiple is not None:
        return multiple
    module = _te_state_module()
    if module is None or not module.FP8GlobalStateManager.is_fp8_enabled():
        return DEFAULT_FP8_MULTIPLE
    recipe = module.FP8GlobalStateManager.get_fp8_recipe()
    align = getattr(module, "get_align_size_for_quantization", None)
    if callable(align):
        return int(align(recipe))
    is_mxfp8 = getattr(recipe, "mxfp8", None)
    return 32 if callable(is_mxfp8) and is_mxfp8() else DEFAULT_FP8_MULTIPLE


def _check_multiple(multiple: int) -> int:
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise MediaInputError(
            f"FP8 padding multiple must be a positive int, got {multiple!r}",
            context={"multiple": repr(multiple)},
        )
    return multiple


def padded_multiple(multiple: int, group: int) -> int:
    """The smallest multiple of ``multiple`` that keeps whole merge groups of ``group`` rows."""
    return math.lcm(_check_multiple(multiple), _check_multiple(group))


def pad_for_fp8(
    patches: torch.Tensor, multiple: int = DEFAULT_FP8_MULTIPLE
) -> tuple[torch.Tensor, int]:
    """``patches [n, d]`` with zero rows appended to a multiple of ``multiple``: ``(padded,
    n_pad)`` (``patches`` itself when none); autograd flows through the real rows."""
    _check_multiple(multiple)
    if not isinstance(patches, torch.Tensor) or patches.ndim != 2:
        shape = (
            tuple(patches.shape) if isinstance(patches, torch.Tensor) else type(patches).__name__
        )
        raise MediaInputError(f"FP8 padding takes patches [n, d], got {shape}")
    n_pad = -patches.shape[0] % multiple
    if n_pad == 0:
        return patches, 0
    return torch.cat([patches, patches.new_zeros(n_pad, patches.shape[1])], dim=0), n_pad
