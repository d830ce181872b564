"""The post-mortem side: ``records`` (``RankInfo``, ``GuardRecord``, schema v1, summary
lines), ``log`` (``DiagnosticsLog``: one fsync-ed JSONL file per rank, and the library's
logger), ``report`` (streaming reader over every rank's file) and ``report_format``.

Imports no torch at module level (``media-guard report`` and ``--help`` stay fast) and
nothing from the package but ``errors``.
"""

from .log import DiagnosticsLog, get_logger
from .records import (
    EVENTS,
    FILE_PREFIX,
    FILE_SUFFIX,
    LOGGER_NAME,
    SCHEMA_KEYS,
    SCHEMA_VERSION,
    SINGLE_PROCESS,
    EventName,
    GuardRecord,
    RankInfo,
    build_record,
    file_name,
    json_dumps,
    json_safe,
    summary_line,
    utc_now,
    where_text,
)

__all__ = [
    "EVENTS",
    "FILE_PREFIX",
    "FILE_SUFFIX",
    "LOGGER_NAME",
    "SCHEMA_KEYS",
    "SCHEMA_VERSION",
    "SINGLE_PROCESS",
    "DiagnosticsLog",
    "EventName",
    "GuardRecord",
    "RankInfo",
    "build_record",
    "file_name",
    "get_logger",
    "json_dumps",
    "json_safe",
    "summary_line",
    "utc_now",
    "where_text",
]
