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

from kvstore.spawn import DaemonProcess as SpawnedDaemon

ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("KVSTORE_TEST_COMPILED_KERNELS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every daemon, demo and native build a test starts keeps what it writes by default (the tenant
# secret, disk blocks, compiled kernels: kvstore.host.default_cache_dir) in a folder of this session,
# never in the user's ~/.cache (issue #57). Hugging Face's cache stays where it was.
_REAL_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ.setdefault("HF_HOME", os.path.join(_REAL_CACHE, "huggingface"))
SESSION_CACHE = Path(tempfile.mkdtemp(prefix="kvstore-test-cache-"))
os.environ["XDG_CACHE_HOME"] = str(SESSION_CACHE)


def pytest_unconfigure(config) -> None:
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


class DaemonProcess(SpawnedDaemon):
    """A real ``kvstore serve`` subprocess on a unix socket in a test's temp folder."""

    def __init__(self, folder: Path, **settings: object) -> None:
        self.folder = folder
        self.socket = folder / "kvstore.sock"
        super().__init__({"listen": f"unix:{self.socket}", "cpu_capacity": "64MiB",
                          "disk_path": str(folder / "disk"), "disk_capacity": "256MiB",
                          "disk_fsync": "false", "log_level": "WARNING",
                          # one secret for a test's daemons: hosts sharing a bucket share it
                          "tenant_secret_file": str(folder.parent / "tenant-secret"), **settings},
                         log_path=folder / "daemon.log")
        self.log = self.log_path

    def stop(self, signal_kill: bool = False) -> int:
        return super().stop(kill=signal_kill, timeout=30)


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


def exec_after(setup: str, argv: list[str]) -> list[str]:
    """A command line that runs ``argv`` through a fresh Python which first runs ``setup`` (a
    resource limit, a signal disposition, a user id) and then execs it.

    Use it instead of Popen's ``preexec_fn`` or ``user=``, or ``os.fork()``, in a test process: those
    fork with gRPC's threads alive (every test that talked to a daemon leaves them), gRPC's fork
    handlers restart its poller in the child, and the child dies (SIGABRT, "epoll_wait error: Bad
    file descriptor", or SIGSEGV) when it closes its fds before exec: 19-75 in 1,000 such forks on
    the dev VM. Without those options Popen uses vfork, which runs no fork handlers."""
    program = ("import os, resource, signal, sys\n"
               "for name in ('SIGPIPE', 'SIGXFSZ'):  # as Popen leaves them (Python ignores both)\n"
               "    signal.signal(getattr(signal, name), signal.SIG_DFL)\n"
               f"{setup}\nos.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", program, *map(str, argv)]


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
