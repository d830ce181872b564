"""FP8 padding of a re-encoded patch sequence (transformer-engine; optional).

transformer-engine's FP8 GEMMs need the token dimension of a linear's input to be
a multiple of 8 (forward) and the inner dimension a multiple of 16
(``check_dim_for_fp8_exec``); Megatron pads token counts to 16 for FP8 recipes
and 32 for MXFP8 (``get_fp8_align_size``), and newer TE exposes the same rule as
``get_align_size_for_quantization(recipe)`` (16; 32 for MXFP8; 128 for NVFP4).
A re-projected item has an arbitrary patch count, so when FP8 is on the patch
sequence handed to the encoder is padded with zero rows at the end and the
features those rows produce are trimmed off.

The padded rows sit after every real row, so an encoder that maps patches to
features position-wise (patch embed, MLPs, the patch merger) yields the real
features first, unchanged. An encoder with attention over the whole sequence
must keep the padding out of the real rows' attention (Qwen2-VL's vision tower
does so through ``cu_seqlens`` built from ``grid_thw``, which excludes the padding).

transformer-engine is never required: without it (no CUDA, CPU CI) FP8 is only
ever on through the configuration flag.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch

from megatron_media_guard.errors import MediaInputError

DEFAULT_FP8_MULTIPLE = 16

# Where FP8GlobalStateManager lives: TE >= 2.8 moved it to ``quantization``.
_TE_STATE_MODULES = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")


def _te_state_module() -> ModuleType | None:
    """The installed TE module holding ``FP8GlobalStateManager``, or None (TE absent or unusable)."""
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
    """Whether the vision encoder runs under FP8.

    ``config_flag`` (e.g. Megatron's ``config.fp8 is not None``) decides when given.
    When it is None, transformer-engine is asked whether an ``fp8_autocast`` is
    open now (``FP8GlobalStateManager.is_fp8_enabled()``); without TE the answer
    is False. Megatron opens the FP8 context per layer for non-delayed recipes,
    so at the merge the detection can say False while the tower's own layers
    run in FP8: pass the flag when the configuration is known.
    """
    if config_flag is not None:
        return bool(config_flag)
    module = _te_state_module()
    if module is None:
        return False
    return bool(module.FP8GlobalStateManager.is_fp8_enabled())


def fp8_align_size(default: int = DEFAULT_FP8_MULTIPLE) -> int:
    """Rows multiple the active TE recipe needs (16; 32 for MXFP8; 128 for NVFP4).

    ``default`` when TE is absent or no FP8 context is open.
    """
    module = _te_state_module()
    if module is None or not module.FP8GlobalStateManager.is_fp8_enabled():
        return default
    recipe = module.FP8GlobalStateManager.get_fp8_recipe()
    align = getattr(module, "get_align_size_for_quantization", None)
    if callable(align):
        return int(align(recipe))
    is_mxfp8 = getattr(recipe, "mxfp8", None)
    return 32 if callable(is_mxfp8) and is_mxfp8() else default


def fp8_multiple(config_flag: bool | None = None, multiple: int | None = None) -> int | None:
    """The ``fp8_multiple`` to pass to ``reencode``: None when FP8 is off.

    ``multiple`` overrides the size read from TE's recipe (default 16).
    """
    if not fp8_active(config_flag):
        return None
    return multiple if multiple is not None else fp8_align_size()


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
    """Zero rows appended so the row count is a multiple of ``multiple``.

    ``patches [n, d]`` -> ``(padded [n + n_pad, d], n_pad)``; ``patches`` itself
    when ``n_pad == 0``. Autograd flows through the real rows.
    """
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
