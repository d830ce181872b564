"""The core check, in pipeline order: ``grammar`` (a family's placeholder tokens) →
``runs`` (placeholder runs and structural findings, vectorized) → ``items`` (the vision
side's media items) → ``validate`` (input contracts) → ``verify`` (the aligned-path check
on the device) → ``alignment`` (the per-sample report when something is off) → ``plan``
(keep / repair / drop / raise per sample) → ``apply`` (scatter, drop masks, zero-weight
anchor) → ``explain`` (messages and records; ``faults``: those of an adapter's own checks,
LLaVA's collapsed tokens) → ``fault_path`` (``conclude``: the end of every one) → ``guard``
(``MediaGuard``, which runs it all).
``host.to_host`` is the one device-to-host transfer.

Imports torch, ``errors``, ``config`` and ``diagnostics``; never torch.distributed or
megatron. ``guard`` reaches ``repair`` and ``replay`` through function-level imports.
"""
