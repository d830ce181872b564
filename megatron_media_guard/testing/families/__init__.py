"""Tiny random transformers models of every VLM family the guard knows, and batches built from
each family's own arithmetic (tests and benchmarks only; the runtime never imports this).

One module per family (``gemma3.py``, ``nemotron_omni.py``, ...), each with ``FAMILY``,
``tiny_model(seed=0)`` and ``make_batch(model, samples, ...)`` returning a :class:`FamilyBatch`
(see ``base.py``).
"""
