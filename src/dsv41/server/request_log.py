"""Optional JSONL request log: one line per finished request, appended and flushed as it happens."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class RequestLog:
    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, **record) -> None:
        if self._file is None:
            return
        record = {"ts": round(time.time(), 3), **record}
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None
