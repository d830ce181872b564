"""The ``media-guard replay`` arguments, torch-free: ``media-guard replay --help`` prints
them without importing torch (:mod:`.rerun` does the replay and imports it)."""

from __future__ import annotations

import argparse


def positive_bytes(text: str) -> int:
    """argparse type: a byte count >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {value}")
    return value


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
