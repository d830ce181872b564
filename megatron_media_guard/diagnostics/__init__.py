"""The post-mortem side: ``records`` (schema v1), ``log`` (the per-rank JSONL writer, the
logger), ``report`` and its modules (``media-guard report``). No torch; of the package, only
``errors``.
"""

from .log import DiagnosticsLog, get_logger
from .records import (
    EVENTS,
    FILE_PREFIX,
    FILE_SUFFIX,
    LOGGER_NAME,
    SCHEMA_KEYS,
    SCHEMA_VERSION,
    GuardRecord,
    RankInfo,
    build_record,
    file_name,
    json_dumps,
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
    "DiagnosticsLog",
    "GuardRecord",
    "RankInfo",
    "build_record",
    "file_name",
    "get_logger",
    "json_dumps",
    "summary_line",
    "utc_now",
    "where_text",
]
