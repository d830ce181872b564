"""Re-projection of mismatched items: ``pixels`` (layouts), ``reproject`` (resize,
re-patchify, re-encode), ``fp8`` (padding). ``core/repairs.py`` runs a plan's repairs with
them; this package never imports ``core``, torch.distributed or megatron."""
