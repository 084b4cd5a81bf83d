"""The scheduler's leases, sent off its thread.

A hit the connector reports to vLLM is leased in the daemon (a Lookup with ``lease_ms``) so that
it is not evicted before the worker loads it. The scheduler used to wait for that round trip
inside ``get_num_new_matched_tokens``, which vLLM calls on its scheduling thread: every decode step
of every running request waited with it (0.7 ms p50 on an idle 2-core host, 3-5 ms when the
daemon is busy storing). `Leases.send` only queues the keys; one thread sends them in order. The
daemon takes a lease about a round trip after the local lookup that found the hit; a block evicted
in between is a failed load, which vLLM recomputes (the worker reports it,
``get_block_ids_with_load_errors``) and the trace counts.

The queue is bounded (`MAX_WAITING`): while the daemon is slower than the requests, the leases
past it are dropped and counted (``dropped``), never waited for. A lease that fails is counted
(``failed``) and otherwise ignored: the next call on the request's path finds an outage, guarded.

vLLM asks a waiting request's lookup again at every scheduling step until it gets pages; a
request's keys are leased again only when its hit grew or half the lease has run out (``repeated``
counts the asks that sent none), so a queue of waiting requests costs the daemon one lease each,
not one a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

log = logging.getLogger(__name__)

#: Leases waiting for the sender past which new ones are dropped.
MAX_WAITING = 64
#: Requests whose last lease is remembered (the oldest forgotten first: a request vLLM never
#: reported finished costs at most this many entries).
MAX_REMEMBERED = 4096


class Leases:
    def __init__(self, lease: Callable[[Sequence[bytes], float], object]) -> None:
        """``lease(keys, lease_s)``: the leasing Lookup (a guarded `PrefixCache.lookup`, which
        returns None on a failure)."""
        self._lease = lease
        self._waiting: queue.Queue[tuple[Sequence[bytes], float] | None] = queue.Queue(MAX_WAITING)
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._unsent = 0  # queued or being sent
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # request -> (when, keys) of its last lease
        self.sent = self.failed = self.dropped = self.repeated = 0

    def lease(self, request_id: str, keys: Sequence[bytes], lease_s: float) -> None:
        """`send` ``keys`` for ``request_id`` unless its last lease named at least as many (the keys
        are a prefix: a hit that shrank is still leased) and has more than half of ``lease_s`` to run (a repeated ask, counted in ``repeated``). Called from one
        thread (the scheduler's), as `forget` is."""
        now = time.monotonic()
        last = self._last.get(request_id)
        if last is not None and last[1] >= len(keys) and now - last[0] < lease_s / 2:
            self.repeated += 1
            return
        self._last[request_id] = (now, len(keys))
        self._last.move_to_end(request_id)
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)
        self.send(keys, lease_s)

    def forget(self, request_id: str) -> None:
        """The request finished: its next ask (a request id reused) leases anew."""
        self._last.pop(request_id, None)

    def send(self, keys: Sequence[bytes], lease_s: float) -> None:
        """Lease ``keys`` for ``lease_s`` without waiting (dropped, and counted, when `MAX_WAITING` wait)."""
        with self._idle:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-lease", daemon=True)
                self._thread.start()
            try:
                self._waiting.put_nowait((keys, lease_s))
            except queue.Full:
                self.dropped += 1
                return
            self._unsent += 1

    def _run(self) -> None:
        while (job := self._waiting.get()) is not None:
            try:
                found = self._lease(*job)
            except Exception as exc:  # noqa: BLE001 - a lease is a hint: the load decides
                log.debug("a lease failed: %s", exc)
                found = None
            with self._idle:
                if found is None:
                    self.failed += 1
                else:
                    self.sent += 1
                self._unsent -= 1
                self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every lease queued so far was sent (or failed) within ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unsent == 0, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (at most ``timeout``), then end the thread."""
        thread = self._thread
        if thread is None:
            return
        try:
            self._waiting.put(None, timeout=timeout)
        except queue.Full:
            return
        thread.join(timeout)
