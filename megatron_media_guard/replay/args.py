"""The ``media-guard replay`` arguments, torch-free: ``media-guard replay --help`` prints
them without importing torch (:mod:`.rerun` does the replay and imports it)."""

from __future__ import annotations

import argparse

from .bundle_limits import LimitError, parse_max_bytes


def positive_bytes(text: str) -> int:
    """argparse type: a byte count >= 1."""
    try:
        return parse_max_bytes(text, "--max-bytes")
    except LimitError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``media-guard replay``."""
    parser.add_argument("bundle", help="a media_guard.rank*.bundle file")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (also for an unreadable bundle)"
    )
    parser.add_argument(
        "--max-bytes",
        type=positive_bytes,
        default=None,
        metavar="N",
        help="refuse a bundle declaring more than N bytes of tensors, before reading them "
        "(default: $MEDIA_GUARD_REPLAY_MAX_BYTES or 1 GiB)",
    )
