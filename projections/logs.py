"""How the ``jetsourcing`` command logs: human lines, or one JSON object per line (``--log-format json``)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Literal

__all__ = ["JsonFormatter", "configure_logging"]

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, RFC 3339), ``level``, ``logger``, ``message``, the traceback as
    ``exception`` when there is one, and any ``extra=`` fields the call gave."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: Literal["text", "json"]) -> None:
    """Log to stderr at ``level``, as text lines or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
