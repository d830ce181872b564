"""megatron-energon: the media check inside a ``TaskEncoder`` (recipe: docs/DATA_SIDE.md), in
``encode_batch`` or ``postencode_sample``. A sample the check drops becomes energon's
``SkipSample`` (``on_drop="skip"``) or stays text-only with its labels ignored (``"mask"``);
one the guard raises for becomes ``FatalSampleError``, which energon never swallows;
``policy="repair"`` re-processes items from the originals given. Imports energon lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..errors import MediaAlignmentError, MediaInputError
from ..families.collate import BatchCheck, check_batch

OnDrop = Literal["skip", "mask"]


def _energon():
    """megatron-energon's own exceptions (``megatron.energon.errors``), imported when needed."""
    try:
        from megatron.energon import errors
    except ImportError as err:  # pragma: no cover - the test extra installs it
        raise MediaInputError(
            "guard_batch needs megatron-energon (pip install megatron-energon)"
        ) from err
    return errors


def guard_batch(
    inputs: Mapping[str, Any], family: str, *, on_drop: OnDrop = "skip", **check_kw: Any
) -> BatchCheck:
    """:func:`~megatron_media_guard.families.collate.check_batch` on ``inputs`` (the model's
    keyword arguments, ``input_ids`` ``[b, s]``), its outcome in energon's terms (module
    docstring). check_kw: ``check_batch``'s keywords (``config=``, required; ``tokenizer=``,
    ``guard=``, ``media=``, ``processor=``, ``step=``, ...). Returns the :class:`BatchCheck`
    (``.batch``: the inputs to feed the model)."""
    if on_drop not in ("skip", "mask"):
        raise MediaInputError(f"guard_batch(on_drop=...) must be 'skip' or 'mask', got {on_drop!r}")
    try:
        checked = check_batch(family, inputs, **check_kw)
    except MediaAlignmentError as err:
        raise _energon().FatalSampleError(f"media guard: {err}") from err
    if checked.dropped and on_drop == "skip":
        rep = checked.report
        raise _energon().SkipSample(
            f"media guard dropped sample(s) {list(rep.dropped)} of {rep.num_samples} "
            "(placeholder runs and media disagree; see the guard's log)"
        )
    return checked


__all__ = ["guard_batch"]
