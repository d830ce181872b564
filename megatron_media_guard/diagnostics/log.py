"""The per-rank JSONL writer and the library's logger. :meth:`DiagnosticsLog.emit` returns once
the line is on disk and never raises (docs/DIAGNOSTICS.md, "Durability guarantee", states what
that takes). Never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from .records import (
    LOGGER_NAME,
    GuardRecord,
    RankInfo,
    build_record,
    file_name,
    json_dumps,
    summary_line,
    utc_now,
)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (survives stream swaps in tests)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


_LOGGER_LOCK = threading.Lock()
_WARN_EVENTS = frozenset({"drop", "raise", "budget", "repair"})  # seen even at WARNING level


def get_logger() -> logging.Logger:
    """The library logger: level INFO, one stderr handler (added once), not propagated to root."""
    logger = logging.getLogger(LOGGER_NAME)
    with _LOGGER_LOCK:
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    return logger


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` of a regular file, never blocking: opened with ``O_NONBLOCK`` (a FIFO
    without a peer opens at once), then anything but a regular file is closed and refused
    with an OSError naming its kind, and the descriptor is made blocking again."""
    flags |= getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "special file")
            raise OSError(f"not a regular file ({kind})")
        os.set_blocking(fd, True)
    except OSError:
        os.close(fd)
        raise
    return fd


def _caller_name(depth: int) -> str | None:
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:
        return None
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    return f"{frame.f_globals.get('__name__', '?')}:{name}"


class DiagnosticsLog:
    """Append-only JSONL writer for one rank; thread-safe; a context manager.

    log_dir: directory for ``media_guard.rank{global_rank:05d}.jsonl`` (created on
    the first record); None writes no file, only the logger line.
    rank_source: called at each record for this rank's coordinates (e.g. torch.distributed's
    rank once it is initialized: a writer built before ``init_process_group`` still names its
    own rank and file); None: ``rank`` as given, fixed.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None,
        rank: RankInfo | None = None,
        *,
        rank_source: Callable[[], RankInfo] | None = None,
    ):
        self._rank_source = rank_source
        if rank is None:
            rank = rank_source() if rank_source is not None else RankInfo.from_env()
        self.rank = rank
        self._dir = None if log_dir is None else Path(log_dir)
        self.path: Path | None = None if self._dir is None else self._dir / file_name(rank.rank)
        self.host = socket.gethostname()
        self.write_errors = 0
        self.last_error: str | None = None  # why the last write failed; None: it succeeded
        self._end: int | None = None  # file size after this writer's last good write
        self._readable = True  # the descriptor can read back the file's last byte
        self._fd: int | None = None
        self._fd_pid: int | None = None
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._logger = get_logger()

    # -- writing ----------------------------------------------------------------
    def emit(self, record: GuardRecord, *, caller: str | None = None) -> dict[str, object]:
        """Write ``record`` as one fsync-ed line, log its summary, return the object written.
        Never raises: a write failure is counted and logged once (:meth:`describe_path` says
        so), a record that cannot be serialized is written as its event alone, naming why."""
        caller = caller if caller is not None else _caller_name(1)
        if self._rank_source is not None:
            self._refresh_rank()
        when, pid = utc_now(), os.getpid()
        try:
            rec = build_record(record, self.rank, time=when, host=self.host, pid=pid, caller=caller)
            line = (json_dumps(rec) + "\n").encode("utf-8")
        except Exception as err:  # a hostile field: the record must still say what happened
            why = GuardRecord(
                record.event, reason=f"record could not be serialized ({type(err).__name__})"
            )
            rank = RankInfo(self.rank.rank if type(self.rank.rank) is int else None)
            rec = build_record(why, rank, time=when, host=self.host, pid=pid, caller=caller)
            line = (json_dumps(rec) + "\n").encode("utf-8")
        if self.path is not None:
            with self._locked():
                self._write(line)
        level = logging.WARNING if record.event in _WARN_EVENTS else logging.INFO
        if self._logger.isEnabledFor(level):
            self._logger.log(level, "%s", summary_line(rec))
        return rec

    def _refresh_rank(self) -> None:
        try:
            rank = self._rank_source()  # type: ignore[misc]
        except Exception:  # a half-torn-down process group: keep the last known rank
            return
        if rank == self.rank:
            return
        self.rank = rank
        if self._dir is not None and self.path != self._dir / file_name(rank.rank):
            with self._locked():
                self._close_fd()
                self.path, self._end = self._dir / file_name(rank.rank), None

    def _locked(self) -> threading.Lock:
        """This writer's lock; a new one in a forked child (the parent's may be held)."""
        if os.getpid() != self._lock_pid:
            self._lock, self._lock_pid = threading.Lock(), os.getpid()
        return self._lock

    def describe_path(self) -> str | None:
        """The log path for a message: None without a log directory; the path when the last
        write succeeded; the path with why nothing could be written there otherwise."""
        if self.path is None:
            return None
        if self.last_error is None:
            return str(self.path)
        return (
            f"{self.path} (write FAILED: {self.last_error}; this record is only in the "
            "logger output)"
        )

    def _write(self, data: bytes) -> None:
        try:
            fd = self._open()
            size = os.fstat(fd).st_size
            stale = size != self._end and size > 0  # not where this writer left the file
            # a write-only file cannot be looked at: a blank line is harmless, a glued record is not
            if stale and (not self._readable or os.pread(fd, 1, size - 1) != b"\n"):
                data = b"\n" + data  # terminate a torn line: only that line is lost
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            self._end, self.last_error = size + len(data), None
        except OSError as err:
            # A diagnostics failure must not mask the error the guard is about to raise.
            self._end = None  # the tail may be torn: check it before the next record
            self.last_error = f"{type(err).__name__}: {err}"
            self.write_errors += 1
            if self.write_errors == 1:
                self._logger.error(
                    "[media-guard] cannot write diagnostics to %s: %s", self.path, err
                )

    def _open(self) -> int:
        pid = os.getpid()
        if self._fd is not None and self._fd_pid == pid:
            return self._fd
        if self._fd is not None:  # inherited across fork: the child opens its own
            self._close_fd()
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_APPEND | os.O_CREAT
        try:
            fd, self._readable = open_regular(self.path, flags | os.O_RDWR), True
        except PermissionError:  # a write-only file: append without reading the tail back
            fd, self._readable = open_regular(self.path, flags | os.O_WRONLY), False
        self._fd, self._fd_pid, self._end = fd, pid, None  # None: check the tail first
        return fd

    def _close_fd(self) -> None:
        fd, self._fd, self._fd_pid = self._fd, None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close the file (idempotent); a later ``emit`` reopens it."""
        with self._lock:
            self._close_fd()

    def __enter__(self) -> DiagnosticsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
