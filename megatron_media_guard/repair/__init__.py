"""Re-projection of mismatched items: ``pixels`` (layouts: image, Qwen patches),
``reproject`` (resize on the item's device, re-patchify, re-encode, verify the count),
``repairs`` (runs a plan's repairs and records them), ``fp8`` (FP8 padding multiples).

Imports torch, ``core`` and ``geometry``; never torch.distributed or megatron.
"""
