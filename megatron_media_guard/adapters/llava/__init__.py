"""megatron-core ``LLaVAModel._preprocess_data`` (0.16 and 0.19, Nemotron VL / Omni through
Megatron-Bridge): collapsed image tokens, packed dynamic resolution, sound, THD rows
(docs/MEGATRON.md)."""

from .checks import llava_grammar
from .install import LlavaHandle, LlavaResult, install_llava

__all__ = ["LlavaHandle", "LlavaResult", "install_llava", "llava_grammar"]
