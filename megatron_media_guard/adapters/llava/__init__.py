"""megatron-core ``LLaVAModel._preprocess_data`` (0.16 and 0.19, Nemotron VL / Omni through
Megatron-Bridge): collapsed image tokens, packed dynamic resolution, sound, THD rows.

``install`` (the wrapper, the forward pre-hook, the call's records and conclusion),
``measure`` (every per-sample count in one device-to-host transfer), ``packed`` (rows and THD
sub-samples), ``checks`` (faults, argument shapes), ``sound`` (clips to samples), ``drop`` (the
input rewrite that drops without copying features). See docs/MEGATRON.md.
"""

from .checks import llava_grammar
from .install import LlavaHandle, LlavaResult, install_llava

__all__ = ["LlavaHandle", "LlavaResult", "install_llava", "llava_grammar"]
