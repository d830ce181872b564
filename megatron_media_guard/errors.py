"""The library's one exception family.

Inner code raises with the fact it found; the public call that catches it
re-raises with the context the user needs (rank, step, sample, item), in the
spirit of einops' layered errors. ``context`` carries the same facts as data.
"""

from __future__ import annotations

from collections.abc import Mapping


class MediaAlignmentError(RuntimeError):
    """Placeholders and media features disagree, or the guard was given bad input.

    ``context`` is a plain mapping of the facts behind the message (JSON-safe),
    so launchers and tests can read them without parsing text.
    """

    def __init__(self, message: str, *, context: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.context: dict[str, object] = dict(context or {})

    def with_context(self, prefix: str, **context: object) -> MediaAlignmentError:
        """A copy of this error of the same type, message prefixed, context extended."""
        err = type(self).__new__(type(self))
        MediaAlignmentError.__init__(err, f"{prefix}{self}", context={**self.context, **context})
        return err


class MediaInputError(MediaAlignmentError, ValueError):
    """The guard was called with input it cannot interpret (dtype, shape, device, ids)."""


class ConsensusError(MediaAlignmentError):
    """Ranks that must agree (same micro-batch, same stage) did not, or one of them failed."""


class DropBudgetExceeded(MediaAlignmentError):
    """More samples were dropped than the configured budget allows."""
