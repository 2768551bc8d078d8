"""Stop strings over streamed text: cut at the first match, hold back text that could still start one."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str], keep: bool = False):
        self.stops = [s for s in stops if s]
        self.keep = keep  # include_stop_str_in_output: the matched stop string is shown
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to show now; after a match, `stopped` is True and the rest is dropped."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._pending + text
        found = [(i, len(s)) for i, s in ((buffer.find(s), s) for s in self.stops) if i >= 0]
        if found:
            cut, length = min(found, key=lambda f: (f[0], -f[1]))
            self.stopped = True
            self._pending = ""
            return buffer[:cut + length] if self.keep else buffer[:cut]
        hold = self._partial_suffix(buffer)
        self._pending = buffer[len(buffer) - hold:] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """At the end of generation a held-back partial match is just text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
