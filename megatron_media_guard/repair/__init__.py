"""Re-projection of mismatched items: ``pixels`` (layouts: image, Qwen patches),
``reproject`` (resize on the item's device, re-patchify, re-encode, verify the count),
``fp8`` (FP8 padding multiples). Running a plan's repairs is the fault path's
(``core/repairs.py``), which calls these.

Imports torch and ``geometry``, never ``core`` (the core imports this), torch.distributed or
megatron.
"""
