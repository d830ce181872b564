"""Across ranks: ``consensus`` (one small all-reduce per guarded merge: the ranks holding a
micro-batch agree, and a stage raises together) and ``budget`` (the drop budget at step end).
With ``adapters``, the only place that imports torch.distributed (and megatron-core's
``parallel_state``, lazily); single process when torch.distributed is not initialized.
"""

# importing anything of ranks/ registers the default consensus and rank with the core
# (core/providers.py): the core never imports ranks/
from . import defaults as _defaults  # noqa: F401
