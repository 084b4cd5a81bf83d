"""Shared pytest fixtures.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here, at
collection time. The kernel tests compare kernels and references on CPU tensors under the
interpreter; to compile the kernels for real on a GPU, run bench/gpu_check.py (or set
KVSTORE_TEST_COMPILED_KERNELS=1 for a test session on CUDA).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("KVSTORE_TEST_COMPILED_KERNELS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent


class DaemonProcess:
    """A real ``kvstore serve`` subprocess on a unix socket in a temp folder."""

    def __init__(self, folder: Path, **settings: object) -> None:
        self.folder = folder
        self.socket = folder / "kvstore.sock"
        self.address = f"unix:{self.socket}"
        self.settings = {"listen": self.address, "cpu_capacity": "64MiB",
                         "disk_path": str(folder / "disk"), "disk_capacity": "256MiB",
                         "disk_fsync": "false", "log_level": "WARNING", **settings}
        self.proc: subprocess.Popen | None = None
        self.log = folder / "daemon.log"

    def start(self, timeout: float = 30.0) -> "DaemonProcess":
        args = [sys.executable, "-m", "kvstore.cli", "serve"]
        for name, value in self.settings.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self._log_file = open(self.log, "ab")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log_file, cwd=ROOT, env=env)
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline().decode()
        if "ready" not in line or time.monotonic() > deadline:
            self.proc.kill()
            raise RuntimeError(f"daemon did not start: {line!r}\n{self.log.read_text()}")
        return self

    def stop(self, signal_kill: bool = False) -> int:
        if self.proc is None:
            return 0
        if signal_kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        self._log_file.close()
        return code

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def short_tmp():
    """A short temp path: unix socket paths are limited to ~107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="kvs-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def daemon_factory(short_tmp):
    started: list[DaemonProcess] = []

    def make(name: str = "d0", **settings: object) -> DaemonProcess:
        folder = short_tmp / name
        folder.mkdir(exist_ok=True)
        d = DaemonProcess(folder, **settings).start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3 server as a subprocess on 127.0.0.1: real HTTP, boto3 unchanged (``endpoint_url``).

    ``require_auth`` starts it with IAM checks on from the first request, so unknown access keys
    get a real 403 InvalidAccessKeyId (by default moto accepts any credentials).
    """

    def __init__(self, folder: Path, require_auth: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder = folder
        self.require_auth = require_auth
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "MotoServer":
        import socket

        env = dict(os.environ)
        if self.require_auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self._log = open(self.folder / f"moto-{self.port}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=self._log, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self._log.close()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture(scope="session")
def moto_server():
    folder = Path(tempfile.mkdtemp(prefix="kvs-moto-"))
    server = MotoServer(folder).start()
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def s3_bucket(moto_server, monkeypatch, request):
    """A fresh bucket on the session's moto server, with credentials in the environment (the
    daemons started by ``daemon_factory`` inherit them). Yields the bucket name."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    import re

    bucket = "kvs-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + f"-{free_port()}"
    moto_server.client().create_bucket(Bucket=bucket)
    return bucket
