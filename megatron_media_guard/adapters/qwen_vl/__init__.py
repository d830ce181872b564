"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL (transformers and Megatron-Bridge): the inputs are checked
and rewritten before the vision tower, since these models merge inline in ``forward`` and every
item's count follows from its grid row.

``install`` (the forward pre-hook and the handle), ``checks`` (the model's sizes and token ids,
the one-transfer device verdict against the grid rows), ``plan`` (items from grid rows, the
per-sample plan, repairs solved and resized, records), ``rewrite`` (the inputs made to agree:
rows dropped or replaced, placeholders to text, labels and loss mask). See docs/QWEN_VL.md.
"""

from .install import QwenVLHandle, install_handle

__all__ = ["QwenVLHandle", "install_handle"]
