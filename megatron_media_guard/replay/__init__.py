"""Replay bundles: ``bundle_save`` saves a mismatched micro-batch (token ids, item metadata,
optionally pixels) without pickled code, ``bundle`` (the format) loads it back; ``rerun`` is
``media-guard replay BUNDLE``, which reproduces the diagnosis offline.

Imports torch, ``core`` and ``diagnostics``; never torch.distributed.
"""
