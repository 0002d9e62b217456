"""Log output for every command: plain text for people, or one JSON object per line for collectors.

Stdlib logging only: a Formatter, so every module keeps using `logging.getLogger(...)` and `extra=`
fields reach the JSON line as top-level keys.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has: anything else on a record came from `extra=` and is logged as a field.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601, ms), level, logger, message, then `extra=` fields
    and `exc` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(doc, default=str).decode()


def parse_level(value: str) -> str:
    """A level name in any case; anything else is an error rather than a silent INFO."""
    name = value.strip().upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {value!r}; choose one of {', '.join(LOG_LEVELS)}")
    return name


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger once per process (replacing any handler set up before)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; choose one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(parse_level(level))
