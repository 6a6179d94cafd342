"""The log format of the daemon's control processes (supervisor, frontend), and the level of
plan lines: placement describes its plans as text lines, the ones that warn starting with
"warning: "; those are logged at WARNING, without the prefix."""

from __future__ import annotations

import logging
import os
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


# The replica a process belongs to (--data-parallel-rank, or set by cpud -dp for its replicas);
# children inherit it, so a replica's supervisor, frontend and ranks all log its tag.
REPLICA_ENV = "CPUD_DATA_PARALLEL_RANK"


def replica_tag() -> str:
    """The tag "[replica N]" in a process of replica N, else an empty string."""
    value = os.environ.get(REPLICA_ENV, "").strip()
    return f"[replica {value}]" if value else ""


class ReplicaName(logging.Filter):
    """Logger names carry the replica ("cpud.supervisor[replica 1]"): replicas share a journal."""

    def __init__(self, tag: str):
        super().__init__()
        self.suffix = tag

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.endswith(self.suffix):
            record.name += self.suffix
        return True


def configure_logging(level: int = logging.INFO) -> None:
    """INFO and above to stderr in LOG_FORMAT, plan warnings at WARNING, logger names tagged
    with the replica (REPLICA_ENV) when the process belongs to one."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    tag = replica_tag()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, WarningLines) for f in handler.filters):
            handler.addFilter(WarningLines())
        if tag and not any(isinstance(f, ReplicaName) for f in handler.filters):
            handler.addFilter(ReplicaName(tag))
