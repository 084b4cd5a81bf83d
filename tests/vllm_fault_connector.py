"""A KVStoreConnector that kills the daemon just before its first load: the fault of a daemon that
dies between the scheduler's Lookup and the worker's Get, which no real part produces on cue.

Used by tests/test_vllm.py through ``engine_adapter.vllm.run --connector-module``; the daemon's pid
comes in ``KVSTORE_TEST_KILL_PID``. Everything else is the real connector, vLLM and daemon.
"""

from __future__ import annotations

import os
import signal
import time

from engine_adapter.vllm.connector import KVStoreConnector as RealConnector


class KVStoreConnector(RealConnector):
    def start_load_kv(self, forward_context, **kwargs) -> None:
        pid = int(os.environ.get("KVSTORE_TEST_KILL_PID", "0"))
        if pid and self.has_connector_metadata() and self._get_connector_metadata().plan.loads:
            os.environ["KVSTORE_TEST_KILL_PID"] = "0"  # once
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)
        super().start_load_kv(forward_context, **kwargs)
