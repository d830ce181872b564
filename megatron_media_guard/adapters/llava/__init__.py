"""megatron-core ``LLaVAModel._preprocess_data`` (0.16 and 0.19, Nemotron VL / Omni through
Megatron-Bridge): collapsed image tokens, packed dynamic resolution, sound, THD rows.

``install`` (the wrapper and the forward pre-hook), ``measure`` (every per-sample count in one
device-to-host transfer), ``layout`` and ``packed`` (rows and THD sub-samples), ``sound``
(clips to samples), ``checks`` (faults), ``drop`` (the input rewrite that drops without
copying features), ``report`` (messages and records). See docs/MEGATRON.md.
"""

from .checks import llava_grammar
from .install import LlavaHandle, LlavaResult, install_llava

__all__ = ["LlavaHandle", "LlavaResult", "install_llava", "llava_grammar"]
