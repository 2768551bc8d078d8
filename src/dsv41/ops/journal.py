"""Log lines on stdout that journald files under the right priority.

Under systemd, stdout is connected to journald and `JOURNAL_STREAM` is set; with the default
`SyslogLevelPrefix=yes` a leading `<N>` sets the entry's priority (3 err ... 7 debug), so `journalctl -p warning`
works. Outside journald the prefix would be noise, so lines are plain `LEVEL name: message`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

# syslog priorities: emerg 0, alert 1, crit 2, err 3, warning 4, notice 5, info 6, debug 7
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level; custom levels round towards the more severe neighbour."""
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


def under_journald(stream: TextIO) -> bool:
    """True when `stream` is the journald stream systemd connected (JOURNAL_STREAM=dev:inode matches its fd)."""
    value = os.environ.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        dev, inode = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, inode)


class JournalFormatter(logging.Formatter):
    """`<N>name: message` for journald; each continuation line of a traceback keeps the same priority."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


def make_handler(stream: TextIO | None = None, journald: bool | None = None) -> logging.Handler:
    """A stdout handler with `<N>` prefixes under journald (detected unless `journald` is given), plain otherwise."""
    stream = stream if stream is not None else sys.stdout
    if journald is None:
        journald = under_journald(stream)
    handler = logging.StreamHandler(stream)
    if journald:
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def setup_logging(level: int = logging.INFO) -> None:
    """Route the root logger to stdout in the right format (idempotent: replaces handlers it added before)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_dsv41", False):
            root.removeHandler(handler)
    handler = make_handler()
    handler._dsv41 = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
