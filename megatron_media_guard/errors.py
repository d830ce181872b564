"""The library's one exception family.

::

    MediaGuardError                      every error the library raises (catch it for "any")
    ├── MediaAlignmentError (RuntimeError)   a fault in the data: placeholders and features
    │   └── DropBudgetExceeded               disagree (on this rank or a peer of its stage)
    ├── MediaInputError (ValueError)         a wrong call: bad dtype, shape, option, tokenizer
    └── ConsensusError (RuntimeError)        the ranks that must agree did not, or a peer
                                             failed on something other than its data

A trainer that skips a batch on ``except MediaAlignmentError`` never swallows its own wrong
call, and every rank of the stage takes the same branch: a data fault on one rank is a
``MediaAlignmentError`` on all of them, a peer's wrong call (or OOM) a ``ConsensusError``.
Inner code raises with the fact it found; the public call re-raises with the context the
user needs (rank, step, sample, item); ``context`` carries the same facts as data.
"""

from __future__ import annotations

from collections.abc import Mapping


class MediaGuardError(Exception):
    """The root of the library's errors; ``context``: the facts behind the message (JSON-safe)."""

    def __init__(self, message: str, *, context: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.context: dict[str, object] = dict(context or {})

    def with_context(self, prefix: str, **context: object) -> MediaGuardError:
        """A copy of this error of the same type, message prefixed, context extended."""
        err = type(self).__new__(type(self))
        MediaGuardError.__init__(err, f"{prefix}{self}", context={**self.context, **context})
        return err


class MediaAlignmentError(MediaGuardError, RuntimeError):
    """A fault in the data: placeholders and media features disagree (here or on a peer)."""


class MediaInputError(MediaGuardError, ValueError):
    """A wrong call (dtype, shape, device, ids, an option, a tokenizer): the message names the
    function called and what to pass."""


class ConsensusError(MediaGuardError, RuntimeError):
    """Ranks that must agree did not, or a peer failed on something other than its data (a
    wrong call, out of memory): a trainer that skips data faults stops here, as that peer did."""


class DropBudgetExceeded(MediaAlignmentError):
    """More samples were dropped than the configured budget allows."""
