"""Across ranks: ``consensus`` (one small all-reduce per guarded merge that proves the
ranks holding a micro-batch agree, carries the counters and the fatal flag, and makes every
rank of a stage raise together) and ``budget`` (the drop budget at step end).

The only place besides ``adapters`` that imports torch.distributed (and megatron-core's
``parallel_state``, lazily). Degrades to single-process when torch.distributed is not
initialized.
"""

# importing anything of ranks/ registers the default consensus and rank with the core
# (core/providers.py): the core never imports ranks/
from . import defaults as _defaults  # noqa: F401
