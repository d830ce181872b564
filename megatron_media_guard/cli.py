"""``media-guard`` command line: one :class:`Subcommand` per name.

Each subcommand (:data:`SUBCOMMANDS`) imports its heavy modules when its parser is built or
it runs, not at import: ``media-guard --help``, ``report`` and ``replay --help`` import no
torch.

Exit codes: 0 success; 1 ``replay``: the bundle still mismatches, ``smoke``: a scenario
ended unexpectedly, ``report``: output closed early; 2 usage error or missing input;
3 ``report --fail-on`` matched; 4 ``smoke``: a rank crashed or timed out; 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAIL_ON = 3


@dataclass(frozen=True)
class Subcommand:
    """One ``media-guard NAME`` subcommand: its help, its arguments, its run (an exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def int_list(text: str) -> list[int]:
    """argparse type: ``"3"`` or ``"0,2,5"`` -> [0, 2, 5]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 3 or 0,2,5, got {text!r}"
        ) from None


def event_list(text: str) -> list[str]:
    """argparse type: ``"raise"`` or ``"raise,drop"``, each a schema-v1 event name."""
    from .diagnostics import EVENTS

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in EVENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown event(s) {unknown or [text]}; choose from {', '.join(EVENTS)}"
        )
    return names


# -- report -----------------------------------------------------------------------------
def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="log directory holding media_guard.rank*.jsonl (or one file)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained page (heatmap, charts, tables) to FILE",
    )
    p.add_argument(
        "--rank", type=int_list, action="extend", metavar="R", help="only these global ranks"
    )
    p.add_argument("--step", type=int_list, action="extend", metavar="S", help="only these steps")
    p.add_argument(
        "--fail-on",
        type=event_list,
        action="extend",
        metavar="EVENT",
        help=f"exit {EXIT_FAIL_ON} when records of EVENT remain after the filters",
    )
    p.add_argument("--top", type=int, default=20, help="offending sample ids shown (default 20)")
    p.add_argument("--jobs", type=int, help="reader processes (default: one per CPU, up to files)")


def _input_error(args: argparse.Namespace, err: Exception) -> int:
    """Any subcommand's missing, unreadable or invalid input (or unwritable output), raised as
    a :class:`~.errors.MediaInputError`: one line why on stderr and, with ``--json``, one JSON
    object on stdout, ``{"error": why, "exit_code": 2}``; exit 2."""
    from .diagnostics.records import one_line
    from .diagnostics.report_format import neutralise

    why = neutralise(one_line(err, 400))
    print(f"media-guard {args.command}: {why}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": why, "exit_code": EXIT_USAGE}))
    return EXIT_USAGE


def _report_run(args: argparse.Namespace) -> int:
    from .diagnostics.report import summarize
    from .diagnostics.report_format import format_summary, neutralise
    from .errors import MediaInputError

    summary = summarize(
        args.dir, ranks=args.rank, steps=args.step, top=max(0, args.top), jobs=args.jobs
    )
    if not summary.files:  # a CI step reading a wrong path must not pass
        why = f"no media_guard.rank*.jsonl files in {args.dir} (nor its subdirectories)"
        raise MediaInputError(why)
    for path, why in summary.skipped_files.items():
        print(neutralise(f"media-guard report: warning: skipped {path}: {why}"), file=sys.stderr)
    if summary.malformed or summary.torn_files:
        print(
            f"media-guard report: warning: {summary.malformed:,} malformed line(s), "
            f"{len(summary.torn_files)} torn last line(s) skipped",
            file=sys.stderr,
        )
    if args.html:
        from .diagnostics.report_html import write_html

        try:
            size = write_html(summary, args.html)
        except OSError as err:
            why = f"cannot write --html {args.html}: {err.strerror or err}"
            raise MediaInputError(why) from None
        print(neutralise(f"media-guard report: page {args.html} ({size:,} bytes)"), file=sys.stderr)
    fail_on = dict.fromkeys(args.fail_on or [])
    hits = {e: summary.count(e) for e in fail_on if summary.count(e)}
    if args.json:
        out = summary.to_dict()
        if fail_on:
            out["fail_on"] = {"events": list(fail_on), "hits": hits}
        print(json.dumps(out))
    else:
        print(format_summary(summary))
    if hits:
        found = ", ".join(f"{n:,} {e!r}" for e, n in hits.items())
        print(f"media-guard report: --fail-on matched {found} record(s)", file=sys.stderr)
        return EXIT_FAIL_ON
    return EXIT_OK


def _byte_count(text: str) -> int:
    """argparse type: a byte count >= 1."""
    from .replay.bundle_limits import LimitError, parse_max_bytes  # torch-free

    try:
        return parse_max_bytes(text, "--max-bytes")
    except LimitError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="a media_guard.rank*.bundle file")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (also for an unreadable bundle)"
    )
    p.add_argument(
        "--max-bytes",
        type=_byte_count,
        default=None,
        metavar="N",
        help="refuse a bundle declaring more than N bytes of tensors, before reading them "
        "(default: $MEDIA_GUARD_REPLAY_MAX_BYTES or 1 GiB)",
    )


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported when first called (the torch-side subcommands)."""

    def call(arg):
        return getattr(importlib.import_module(module, __package__), name)(arg)

    return call


SUBCOMMANDS: dict[str, Subcommand] = {
    "report": Subcommand(
        "post-mortem summary of all ranks' media_guard.rank*.jsonl files",
        _report_arguments,
        _report_run,
    ),
    "replay": Subcommand(
        "re-run the check on a saved micro-batch offline (exit 0 aligned, 1 mismatch, 2 bad "
        "bundle)",
        _replay_arguments,
        _lazy(".replay.rerun", "run_replay"),
    ),
    "smoke": Subcommand(
        "distributed smoke run with fault injection (4 CPU ranks over gloo by default)",
        _lazy(".smoke", "add_smoke_arguments"),
        _lazy(".smoke", "run_smoke"),
    ),
}


# -- entry point ------------------------------------------------------------------------
def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``media-guard`` parser. ``only``: define the arguments of that subcommand alone
    (the others are listed with their help): ``media-guard --help`` and ``report`` then never
    import the torch-side module ``smoke`` defines its arguments in."""
    parser = argparse.ArgumentParser(
        prog="media-guard", description="Guard for merging media features into text embeddings."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if only is None or name == only:
            cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``media-guard`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if a in SUBCOMMANDS), "")  # the first word naming one
    parser = build_parser(only=chosen)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a usage error (2)
        code = stop.code
        return code if isinstance(code, int) else EXIT_OK if code is None else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .errors import MediaInputError

    try:
        return SUBCOMMANDS[args.command].run(args)
    except MediaInputError as err:
        return _input_error(args, err)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `media-guard report DIR | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
