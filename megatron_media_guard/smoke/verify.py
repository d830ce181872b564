"""After the ranks return: read the per-rank JSONL files back and hold every run to its
expectation. Produces the post-mortem summary, the scenario x policy table and the list of
mismatches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..diagnostics import FILE_PREFIX, FILE_SUFFIX
from ..diagnostics.report import ReportSummary, summarize
from ..diagnostics.report_format import format_summary
from .expect import Row, describe, expected, mismatches, observed, table
from .runspec import RankResult, WorkerArgs


def run_dir(log_dir: str | Path, scenario: str, policy: str) -> Path:
    """Where the ranks write their JSONL for one scenario x policy run."""
    return Path(log_dir) / f"{scenario}.{policy}"


def _summary(paths: Sequence[Path]) -> ReportSummary:
    return summarize(list(paths), jobs=1)


def _page(summary: ReportSummary, path: Path) -> str:
    """Write the post-mortem page next to the logs; the line that says where (or why not)."""
    from ..diagnostics.report_html import write_html

    try:
        write_html(summary, path)
    except OSError as err:
        return f"post-mortem page not written ({path}: {err.strerror or err})"
    return f"post-mortem page: {path.resolve().as_uri()}"


def check_runs(
    args: WorkerArgs, results: Sequence[RankResult], log_dir: str | Path
) -> tuple[bool, str]:
    """(every run as expected, the text to print)."""
    world = len(results)
    dp_of = [r.dp for r in sorted(results, key=lambda r: r.rank)]
    rows: list[Row] = []
    for scenario in args.scenarios:
        for policy in args.policies:
            d = run_dir(log_dir, scenario, policy)
            files = sorted(d.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))
            by_rank = _summary(files).by_rank if files else {}
            obs = [
                o
                for r in results
                for o in r.observations
                if (o.scenario, o.policy) == (scenario, policy)
            ]
            want = expected(
                scenario, policy, dp_of, args.fault_rank, args.fault_step, args.steps, args.seed
            )
            got = observed(obs, by_rank)
            problems = mismatches(want, got)
            if len(obs) != world:
                problems.insert(0, f"{len(obs)} of {world} ranks reported this run")
            rows.append(
                Row(
                    scenario,
                    policy,
                    describe(want, world, args.steps),
                    describe(got, world, args.steps),
                    tuple(problems),
                )
            )
    every = sorted(Path(log_dir).glob(f"*/{FILE_PREFIX}*{FILE_SUFFIX}"))
    out = ["", "== post-mortem: every rank's diagnostics, all runs (report.summarize) =="]
    if every:
        post = _summary(every)
        out.append(format_summary(post))
        out.append(_page(post, Path(log_dir) / "report.html"))
    else:
        out.append("no diagnostics files were written")
    out += ["", "== scenario x policy: expected vs observed =="]
    out.append(table(rows))
    bad = [r for r in rows if not r.ok]
    if bad:
        out += ["", f"{len(bad)} run(s) did not end as expected:"]
        for r in bad:
            out += [f"  {r.scenario}/{r.policy}:"] + [f"    - {p}" for p in r.problems]
    return not bad, "\n".join(out)
