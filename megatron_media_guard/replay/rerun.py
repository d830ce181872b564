"""Offline replay of a saved bundle: the guard's check re-run on CPU, one process.

``media-guard replay BUNDLE [--json]`` loads a bundle (:mod:`.bundle`), rebuilds the
alignment report and prints the message the live merge raised (``where`` names the
replay), plus what the bundle's config plans for each sample (exit codes: :func:`run_replay`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ..config import GuardConfig
from ..core.alignment import AlignmentReport, check_alignment
from ..core.explain import alignment_message, batch_summary, sample_record
from ..core.plan import build_plan
from ..core.verify import Verdict
from ..diagnostics import where_text
from ..diagnostics.records import one_line
from ..diagnostics.report_format import neutralise
from ..errors import MediaGuardError, MediaInputError
from .bundle import Bundle, BundleError, _json_default, load_bundle, report_summary

EXIT_ALIGNED, EXIT_MISMATCH = 0, 1


@dataclass(frozen=True)
class ReplayResult:
    """The check re-run on a bundle. ``mismatched``: samples that fail now; ``actions``:
    per sample, what the bundle's config (default config if none saved) plans for them;
    ``saved_mismatched``: samples that failed when the bundle was saved."""

    path: Path
    where: str
    report: AlignmentReport
    message: str
    mismatched: tuple[int, ...]
    actions: tuple[str, ...]
    saved_mismatched: tuple[int, ...]

    @property
    def aligned(self) -> bool:
        return self.report.ok

    def to_dict(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "where": self.where,
            "aligned": self.aligned,
            "mismatched": list(self.mismatched),
            "saved_mismatched": list(self.saved_mismatched),
            "actions": list(self.actions),
            "message": self.message,
            "report": report_summary(self.report),
        }


def replay(bundle: Bundle) -> ReplayResult:
    """Re-run the guard's check on a bundle (CPU, single process); the message is the one
    the live merge raises, for every mismatched sample, with ``where`` naming the replay."""
    rank = bundle.rank.rank if bundle.rank is not None else None
    where = "replay of " + where_text(rank, bundle.step, bundle.microbatch)
    try:
        report = check_alignment(bundle.input_ids, bundle.items, bundle.grammar, bundle.cu_seqlens)
    except MediaGuardError as err:
        raise BundleError(f"{bundle.path}: bundle content is inconsistent: {err}") from None
    bad = tuple(r.sample for r in report.mismatched)
    verdict = Verdict(report.num_runs, len(bad), len(report.stray_findings), 0, 0)
    config = bundle.config or GuardConfig()
    plan = build_plan(len(report.samples), bundle.items, verdict, report, config)
    mb = bundle.microbatch
    if report.ok:
        message = (
            f"Media alignment ok ({where}): {len(report.samples)} samples aligned, "
            + batch_summary(report)
        )
    else:
        # no log path: a replay writes no log (the save-time one is the bundle's log_path)
        records = [
            sample_record(rep, bundle.items, "raise", step=bundle.step, microbatch=mb)
            for rep in report.mismatched
        ]
        message = alignment_message(
            where, records, total=len(report.samples), summary=batch_summary(report)
        )
    saved = tuple(int(m["sample"]) for m in bundle.report.get("mismatched", []))
    return ReplayResult(bundle.path, where, report, message, bad, plan.actions, saved)


# ---- command line ------------------------------------------------------------------------
def run_replay(args: argparse.Namespace) -> int:
    """0: aligned now; 1: the mismatch reproduces. A bundle that cannot be read or is invalid
    raises :class:`~.bundle.BundleError`: the CLI's exit 2 with one line why, never a
    traceback, never 1."""
    try:
        result = replay(load_bundle(args.bundle, max_bytes=args.max_bytes))
    except MediaInputError:
        raise
    except Exception as err:  # whatever an invalid bundle trips in the replay itself
        why = one_line(f"{type(err).__name__}: {err}", 400)
        raise BundleError(f"{args.bundle}: invalid bundle ({why})") from None
    if args.json:
        print(json.dumps(result.to_dict(), default=_json_default))
    else:
        print(neutralise(result.message))  # a bundle is untrusted: no raw escapes reach the tty
        if result.saved_mismatched:
            print(f"  at save time: mismatched samples {list(result.saved_mismatched)[:16]}")
    return EXIT_ALIGNED if result.aligned else EXIT_MISMATCH
