"""Post-mortem reader for the per-rank diagnostics files (``media-guard report DIR``): finds
the files and reads them (in worker processes for large runs) into a :class:`ReportSummary`;
:mod:`.report_format` renders it as text, :mod:`.report_html` as a page.

Memory stays flat in file size: :mod:`.report_aggregate` streams every line and keeps bounded
counters only: (rank, event, action, reason class) keys, at most ``COMBO_CAP`` (further keys
fold into ``(other)`` per rank); reason classes with digits as ``#``
(``"# features for # placeholders (+#)"``), at most ``LABEL_CAP``; offending sample ids
(repair/drop/raise) in a Misra-Gries counter, exact below 2 x ``TOP_CAPACITY`` distinct ids,
else lower bounds (``sample_ids_exact`` False); the first fatal record (event ``raise``:
earliest time, then lowest rank, step). A torn last line (no trailing newline, or a last
non-blank line that is not valid JSON) is skipped and reported; malformed lines elsewhere are
counted; unknown and missing fields are tolerated.
"""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from os import PathLike
from pathlib import Path

from ..errors import MediaInputError
from .records import FILE_PREFIX, FILE_SUFFIX
from .report_aggregate import PARALLEL_MIN_BYTES, _Aggregator
from .report_summary import ReportSummary


def find_files(paths_or_dir: str | PathLike[str] | Iterable[str | PathLike[str]]) -> list[Path]:
    """The diagnostics files named: a directory's ``media_guard.rank*.jsonl`` (sorted; when it
    holds none directly, those in its subdirectories, e.g. one per smoke run), or files."""
    items = [paths_or_dir] if isinstance(paths_or_dir, (str, PathLike)) else list(paths_or_dir)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            pattern = f"{FILE_PREFIX}*{FILE_SUFFIX}"
            out.extend(sorted(p.glob(pattern)) or sorted(p.rglob(pattern)))
        elif p.exists() or p.is_symlink():  # a special file is reported as skipped, not here
            out.append(p)
        else:
            raise MediaInputError(
                f"no such diagnostics directory or file: {str(p)!r}", context={"path": str(p)}
            )
    return out


def _read_one(task: tuple[Path, int, frozenset[int] | None, frozenset[int] | None]) -> _Aggregator:
    path, index, ranks, steps = task
    agg = _Aggregator(ranks, steps)
    agg.read(path, index)
    return agg


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _size(path: Path) -> int:
    """Bytes of a regular file; 0 for anything else (never opens it: a FIFO would block)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def auto_jobs(files: list[Path]) -> int:
    """Worker processes for ``files``: one per CPU up to one per file, 1 below 32 MiB in all.

    Parallel reading needs the ``fork`` start method (Linux) and a process without
    other Python threads; elsewhere it is 1.
    """
    if (
        len(files) < 2
        or "fork" not in multiprocessing.get_all_start_methods()
        or threading.active_count() > 1  # forking a threaded process (a trainer) is unsafe
    ):
        return 1
    size = sum(_size(p) for p in files)
    return 1 if size < PARALLEL_MIN_BYTES else max(1, min(len(files), _cpus()))


def summarize(
    paths_or_dir: str | PathLike[str] | Iterable[str | PathLike[str]],
    *,
    ranks: Iterable[int] | None = None,
    steps: Iterable[int] | None = None,
    top: int = 20,
    jobs: int | None = None,
) -> ReportSummary:
    """Stream the diagnostics files and aggregate them (memory flat in file size).

    paths_or_dir: a directory (its ``media_guard.rank*.jsonl``), a file, or several.
    ranks, steps: keep only records of these global ranks / steps (a record without
    a rank takes the rank in its file name; without a step it fails any step filter).
    jobs: processes reading files in parallel (None: :func:`auto_jobs`; 1: this process).
    The result does not depend on ``jobs``. Raises MediaInputError when a path does not exist.
    """
    files = find_files(paths_or_dir)
    agg = _Aggregator(ranks, steps)
    jobs = auto_jobs(files) if jobs is None else max(1, min(jobs, len(files)))
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        tasks = [(p, i, agg.ranks, agg.steps) for i, p in enumerate(files)]
        try:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                for part in pool.map(_read_one, tasks):
                    agg.merge(part)
            return agg.summary(files, top)
        except (OSError, BrokenProcessPool):  # no processes here: read serially
            agg = _Aggregator(agg.ranks, agg.steps)
    for i, path in enumerate(files):
        agg.read(path, i)
    return agg.summary(files, top)
