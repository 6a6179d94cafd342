"""The log format of the daemon's control processes (supervisor, frontend), and the level of
plan lines: placement describes its plans as text lines, the ones that warn starting with
"warning: "; those are logged at WARNING, without the prefix."""

from __future__ import annotations

import logging
import re

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_WARNING_LINE = re.compile(r"^((?:[\w ]+: )?)warning: ", re.DOTALL)


class WarningLines(logging.Filter):
    """An INFO record reading "[topic: ]warning: text" becomes a WARNING "[topic: ]text"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        match = _WARNING_LINE.match(message)
        if match is not None:
            record.msg = match.group(1) + message[match.end() :]
            record.args = None
            record.levelno = logging.WARNING
            record.levelname = logging.getLevelName(logging.WARNING)
        return True


def configure_logging(level: int = logging.INFO) -> None:
    """INFO and above to stderr in LOG_FORMAT, plan warnings at WARNING."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, WarningLines) for f in handler.filters):
            handler.addFilter(WarningLines())
