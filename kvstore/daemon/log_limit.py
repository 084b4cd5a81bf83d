"""Log lines that may recur thousands of times a second: one line per kind a window, counting the rest.

    limit = LogLimit()
    suppressed = limit.admit(("disk", "ValueError"))   # None: stay silent (counted)
    if suppressed is not None:
        log.warning("... (%d more like it in the last minute)", suppressed)

Runs on the caller's thread of choice; not thread-safe (the store and the RPC handlers call it
from the event loop).
"""

from __future__ import annotations

import time
from typing import Hashable


class LogLimit:
    def __init__(self, window_s: float = 60.0, kinds: int = 4096) -> None:
        self.window_s = window_s
        self._kinds_max = kinds
        self._kinds: dict[Hashable, list] = {}  # kind -> [window start (monotonic s), suppressed]

    def admit(self, kind: Hashable) -> int | None:
        """None: stay silent; else log now, the returned count being how many lines of this kind
        were suppressed since the last one."""
        now = time.monotonic()
        entry = self._kinds.get(kind)
        if entry is None or now - entry[0] >= self.window_s:
            if len(self._kinds) > self._kinds_max:  # many kinds (tenants): forget, log them again
                self._kinds.clear()
            suppressed = entry[1] if entry is not None else 0
            self._kinds[kind] = [now, 0]
            return suppressed
        entry[1] += 1
        return None
