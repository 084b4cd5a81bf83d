"""Run a kvstore daemon as a child process: the demo, the benchmarks and the tests start theirs here.

    with DaemonProcess({"listen": "unix:/tmp/kv.sock", "cpu_capacity": "1GiB", "disk_path": ""}) as daemon:
        client = KVStoreClient(daemon.address)

Settings are ``kvstore serve`` flags by field name (see kvstore/daemon/config.py). ``KVSTORE_*`` variables
of the parent are not passed on, so a child runs with exactly the settings given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping


class DaemonProcess:
    def __init__(self, settings: Mapping[str, object], log_path: str | os.PathLike | None = None) -> None:
        if "listen" not in settings:
            raise ValueError("settings need a listen address, e.g. {'listen': 'unix:/tmp/kvstore.sock'}")
        self.settings = dict(settings)
        self.address = str(settings["listen"])
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def in_folder(cls, folder: str | os.PathLike, **settings: object) -> "DaemonProcess":
        """Start one listening on ``folder/kvstore.sock`` (created), logging to ``folder/daemon.log``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        return cls({"listen": f"unix:{folder / 'kvstore.sock'}", "log_level": "WARNING", **settings},
                   log_path=folder / "daemon.log").start()

    def start(self) -> "DaemonProcess":
        """Start the daemon and wait until it says it is ready; RuntimeError with its log if not."""
        args = [sys.executable, "-m", "kvstore.cli", "serve"]
        for name, value in self.settings.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        # The child imports this same kvstore, installed or not.
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, env=env)
        line = self.proc.stdout.readline().decode()
        if "ready" not in line:
            self.proc.kill()
            self.proc.wait()
            log = self.log_path.read_text()[-4000:] if self.log_path else ""
            raise RuntimeError(f"the kvstore daemon did not start ({line.strip()!r})\n{log}")
        return self

    def stop(self, kill: bool = False, timeout: float = 60.0) -> int:
        """SIGTERM (drains queued writes) or, with ``kill``, SIGKILL; returns the exit code."""
        if self.proc is None:
            return 0
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc.stdout.close()
        self.proc = None
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        return code

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "DaemonProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
