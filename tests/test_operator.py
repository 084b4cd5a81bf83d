"""What an operator meets: one daemon per socket and per disk folder, and start-up failures that
are one line naming what to fix. Every test runs real ``kvstore`` processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.spawn import DaemonProcess as SpawnedDaemon
from tests.conftest import ROOT, DaemonProcess, free_port
from tests.test_daemon import BLOCK, NS, make_blocks

SMALL = {"cpu_capacity": "16MiB", "disk_capacity": "64MiB", "disk_fsync": "false"}


def kvstore(*args: object, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``kvstore ARGS`` as the user would, without the parent's KVSTORE_* variables."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "kvstore.cli", *map(str, args)], env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def serve(**settings: object) -> list[str]:
    """``kvstore serve`` arguments: small tiers, errors only in the log, then ``settings`` (None:
    no flag)."""
    args = ["serve"]
    for name, value in {**SMALL, "log_level": "ERROR", **settings}.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return args


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """Wait for ``proc`` (killed past ``timeout``: a daemon that started by mistake must not linger)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err


def one_line_error(result: tuple[int, str, str], *words: str) -> str:
    """The single ``kvstore: ...`` line of a failed command (exit 1, no traceback), holding ``words``."""
    code, out, err = result
    lines = err.strip().splitlines()
    assert code == 1 and "ready" not in out, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("kvstore: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# -- one daemon per socket and per disk folder ----------------------------------------------------


@contextlib.contextmanager
def holding_flock(lock: Path, then: str = "pass"):
    """Another process that holds the flock on ``lock`` (and then runs ``then``, Python with ``fd``
    and ``os`` at hand) for the block's duration."""
    script = (f"import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
              f"print('locked', flush=True); {then}; time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        yield child
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_a_refused_daemon_waits_for_the_winners_pid(tmp_path):
    """The winner of a start-up race takes the flock, then writes its pid: in between, the loser
    finds the file empty or holding a dead former holder's pid, and must name the winner anyway
    (seen as "pid unknown" in a suite run on a busy 2-core host)."""
    from kvstore.instance_lock import InstanceLock, LockError

    lock = tmp_path / "kvstore.lock"
    lock.write_text("999999999\n")  # beyond any pid_max: a holder long gone
    then = "time.sleep(0.3); os.ftruncate(fd, 0); os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)"
    with holding_flock(lock, then) as winner:
        with pytest.raises(LockError, match=f"in use by a running daemon \\(pid {winner.pid}\\)"):
            InstanceLock(lock, "the folder")


def test_a_lock_file_without_a_live_pid_is_named_as_such(tmp_path, monkeypatch):
    """A holder that never writes its pid (another pid namespace, or a file someone wrote): after
    the wait the refusal says what the file holds, and is still the one-line LockError."""
    from kvstore import instance_lock

    monkeypatch.setattr(instance_lock, "HOLDER_WAIT_S", 0.2)
    lock = tmp_path / "kvstore.lock"
    lock.write_text("\u00b2\n")  # a digit to str.isdigit, not to int()
    with holding_flock(lock):
        with pytest.raises(instance_lock.LockError, match="pid unknown; the lock file says '\u00b2'"):
            instance_lock.InstanceLock(lock, "the folder")


def test_two_daemons_started_at_once_on_one_socket_one_wins(short_tmp):
    """guarantees: one daemon per socket, even when two start at the same moment (flock, not a
    check-then-bind), and the loser names the winner's pid."""
    sock = short_tmp / "kvstore.sock"
    procs = [kvstore(*serve(listen=f"unix:{sock}", disk_path=short_tmp / f"disk{i}")) for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        losers = [p for p in procs if p.poll() is not None]
        assert len(losers) == 1, "exactly one of the two must give up"
        winner = next(p for p in procs if p is not losers[0])
        assert winner.stdout.readline().startswith("kvstore: ready")
        one_line_error(finish(losers[0]), f"unix socket {sock} is in use by a running daemon",
                       f"pid {winner.pid}")
        with KVStoreClient(f"unix:{sock}") as client:  # the winner never noticed
            assert client.stats()["tiers"]["cpu"]["blocks"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.communicate(timeout=30)


def test_folders_the_daemon_creates_are_private(short_tmp):
    """guarantees: the socket's folder, the disk folder and its fan-out folders are created 0700."""
    run = short_tmp / "run" / "kv"
    disk = short_tmp / "cache" / "blocks"
    with SpawnedDaemon.in_folder(short_tmp / "log", listen=f"unix:{run / 'kvstore.sock'}", disk_path=disk,
                                 write_policy="write-through", **SMALL) as d:
        keys, payloads = make_blocks(3, seed=7)
        with KVStoreClient(d.address) as client:
            client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    fanout = [disk / k.hex()[:2] for k in keys]
    for folder in (run, disk, *fanout):
        assert folder.stat().st_mode & 0o777 == 0o700, folder


def test_a_restart_after_kill_9_leaves_foreign_files_and_symlinks_alone(daemon_factory, short_tmp):
    """guarantees: after kill -9 (stale socket and lock files left) the daemon restarts on the same
    socket and folder; the index rebuild reads and deletes only its exact names and follows no
    symlink."""
    d = daemon_factory(**{**SMALL, "disk_fsync": "true"})
    keys, payloads = make_blocks(2, seed=8)
    with KVStoreClient(d.address) as client:  # durable: on disk before kill -9
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)], durable=True)
    disk = d.folder / "disk"
    hexkey = keys[0].hex()
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious"
    target.write_bytes(b"not a block")
    real = disk / hexkey[:2]  # holds a real block: near names beside it must survive
    near_names = ["notes.kvb", hexkey[:-1] + ".kvb", hexkey.upper() + ".kvb", hexkey + ".kvb.bak",
                  f".{hexkey}.tmp.docx", "report.tmp.docx", f".{hexkey}.tmp.12"]
    for name in near_names:
        (real / name).write_bytes(b"someone else's")
    other_hex = "ff" + hexkey[2:] if not hexkey.startswith("ff") else "00" + hexkey[2:]
    (real / f".{other_hex}.tmp.1.2").symlink_to(target)  # a temp name, but a symlink: not ours
    linked = disk / other_hex[:2]
    for name in (other_hex + ".kvb", f".{other_hex}.tmp.1.2"):  # exact names behind a linked folder
        (elsewhere / name).write_bytes(b"someone else's")
    linked.symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}

    d.stop(signal_kill=True)
    assert d.socket.exists(), "kill -9 leaves the socket file behind"
    d.start()
    with KVStoreClient(d.address) as client:
        assert client.get(keys, BLOCK) == [p.tobytes() for p in payloads]
        assert client.stats()["tiers"]["disk"]["corrupt"] == 0
    assert all((real / name).read_bytes() == b"someone else's" for name in near_names)
    assert (real / f".{other_hex}.tmp.1.2").is_symlink() and linked.is_symlink()
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


def test_a_path_at_the_socket_that_is_not_a_socket_is_kept(short_tmp):
    """The daemon removes a stale socket, never a file someone else put there."""
    path = short_tmp / "kvstore.sock"
    path.write_text("mine")
    one_line_error(finish(kvstore(*serve(listen=f"unix:{path}", disk_path=""))), str(path), "not a socket")
    assert path.read_text() == "mine"


# -- start-up failures: one line, exit 1 ----------------------------------------------------------


def test_a_busy_tcp_port_is_refused_in_one_line(short_tmp):
    """guarantees: a TCP port in use (by anything, a kvstore daemon included: no SO_REUSEPORT
    sharing) stops the daemon with 'cannot listen on ADDR: address in use'."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        port = free_port()
        token = "busy-port-0123456789"
        with SpawnedDaemon.in_folder(short_tmp / "first", listen=f"127.0.0.1:{port}", disk_path="", auth_token=token,
                                     **SMALL):
            procs = [kvstore(*serve(listen=f"127.0.0.1:{p}", disk_path="", auth_token=token)) for p in (busy, port)]
            for p, number in zip(procs, (busy, port)):
                one_line_error(finish(p), f"kvstore: cannot listen on 127.0.0.1:{number}: address in use")


def test_a_metrics_address_that_cannot_bind_stops_the_daemon(short_tmp):
    """guarantees: metrics asked for and not served is an error naming the address, not a warning;
    the failed daemon leaves no socket behind and the next one starts."""
    sock = short_tmp / "kvstore.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = finish(kvstore(*serve(listen=f"unix:{sock}", disk_path="", metrics_listen=address)))
    one_line_error(result, f"kvstore: cannot serve metrics on {address}: address in use")
    assert not sock.exists()


def test_config_files_that_cannot_be_used_are_named(short_tmp):
    """guarantees: a missing, non-UTF-8 or malformed --config file, or a bad value in it, is one line
    naming the file (and the line, or the key)."""
    malformed = short_tmp / "malformed.toml"
    malformed.write_text('cpu_capacity = "16MiB"\ndisk_path =\n')
    latin1 = short_tmp / "latin1.toml"
    latin1.write_bytes('log_level = "INFO" # caf\xe9\n'.encode("latin-1"))
    bad_value = short_tmp / "bad-value.toml"
    bad_value.write_text('cpu_capacity = "lots"\n')
    missing = short_tmp / "missing.toml"
    cases = [(missing, ["No such file"]), (malformed, ["line 2"]), (latin1, ["not UTF-8"]),
             (bad_value, ["cpu_capacity: not a size: 'lots'"])]
    # No --cpu-capacity flag: it would override the file's value.
    procs = [kvstore(*serve(config=file, listen=f"unix:{short_tmp / 'kv.sock'}", disk_path="", cpu_capacity=None))
             for file, _ in cases]
    for proc, (file, words) in zip(procs, cases):
        one_line_error(finish(proc), f"config file {file}", *words)


def test_a_tenants_file_that_cannot_be_used_is_named(short_tmp):
    """guarantees: a missing, non-UTF-8 or malformed tenants_file is one line naming the file."""
    malformed = short_tmp / "tenants-malformed.toml"
    malformed.write_text('[[tenant]]\nname = "a"\ntoken = \n')
    latin1 = short_tmp / "tenants-latin1.toml"
    latin1.write_bytes('[[tenant]]\nname = "caf\xe9"\ntoken = "t"\n'.encode("latin-1"))
    missing = short_tmp / "tenants-missing.toml"
    cases = [(missing, ["No such file"]), (malformed, ["line 3"]), (latin1, ["not UTF-8"])]
    procs = [kvstore(*serve(tenants_file=file, listen=f"unix:{short_tmp / 'kv.sock'}", disk_path=""))
             for file, _ in cases]
    for proc, (file, words) in zip(procs, cases):
        one_line_error(finish(proc), f"tenants file {file}", *words)


def test_bad_environment_and_flag_values_name_their_source(short_tmp):
    """guarantees: a bad KVSTORE_* value names the variable; a bad flag value names the flag."""
    listen = f"unix:{short_tmp / 'kv.sock'}"
    by_env = kvstore(*serve(listen=listen, disk_path="", cpu_capacity=None), env={"KVSTORE_CPU_CAPACITY": "lots"})
    by_flag = kvstore(*serve(listen=listen, disk_path="", disk_fsync="maybe"))
    one_line_error(finish(by_env), "kvstore: KVSTORE_CPU_CAPACITY: not a size: 'lots'")
    one_line_error(finish(by_flag), "kvstore: --disk-fsync: not a boolean: 'maybe'")


def test_a_disk_path_that_cannot_be_a_folder_is_named(short_tmp):
    """guarantees: a disk_path that cannot be created or written stops the daemon naming it (a path
    under a regular file: refused even to root, who ignores permission bits)."""
    afile = short_tmp / "afile"
    afile.write_text("")
    disk = afile / "blocks"
    result = finish(kvstore(*serve(listen=f"unix:{short_tmp / 'kv.sock'}", disk_path=disk)))
    one_line_error(result, str(disk), "Not a directory")


def test_a_disk_capacity_beyond_the_free_space_shrinks_with_one_warning(short_tmp):
    """guarantees: a disk tier larger than its filesystem's free space starts with the capacity
    shrunk to the free space (plus its blocks), warned once in the log."""
    d = DaemonProcess(short_tmp, **{**SMALL, "disk_capacity": "1000TiB"})  # log_level WARNING
    with d.start():
        with KVStoreClient(d.address) as client:
            capacity = client.stats()["tiers"]["disk"]["capacity_bytes"]
    fs = os.statvfs(short_tmp)
    assert 0 < capacity < 1000 * 2**40
    assert abs(capacity - fs.f_bavail * fs.f_frsize) < 256 * 2**20  # free space now, give or take
    warnings = [line for line in d.log.read_text().splitlines() if "capacity shrunk" in line]
    assert len(warnings) == 1, warnings
    assert "disk tier capacity shrunk from 1000.0 TiB to " in warnings[0]
    assert f"free on {short_tmp / 'disk'}" in warnings[0]


# -- kvstore ingest ----------------------------------------------------------------------------------


def test_ingest_refuses_unreadable_files_before_loading_the_model(short_tmp):
    """guarantees: ``kvstore ingest`` names a missing, non-UTF-8 or folder FILE at once: before the
    model loads (a missing --model would otherwise be the error) and before any daemon is asked."""
    latin1 = short_tmp / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    good = short_tmp / "good.txt"
    good.write_text("fine")
    cases = [(short_tmp / "missing.txt", "No such file"), (latin1, "not UTF-8"), (short_tmp, "Is a directory")]
    procs = [kvstore("ingest", good, path, "--model", short_tmp / "no-model.gguf",
                     "--address", f"unix:{short_tmp / 'no-daemon.sock'}") for path, _ in cases]
    for proc, (path, words) in zip(procs, cases):
        one_line_error(finish(proc), str(path), words)


@pytest.mark.slow
def test_ingest_of_a_text_shorter_than_a_chunk_says_it_stored_nothing(daemon_factory, short_tmp):
    """A text shorter than one chunk (256 tokens) cannot be cached: ingest says so, instead of
    storing nothing silently. Loads the bundled model (several seconds)."""
    pytest.importorskip("gguf")
    try:
        from engine_adapter.reference.loader import find_smollm2_gguf

        find_smollm2_gguf()
    except Exception as exc:  # noqa: BLE001 - no bundled model here
        pytest.skip(f"no bundled model: {exc}")
    d = daemon_factory(**SMALL)
    short = short_tmp / "short.txt"
    short.write_text("A short note.")
    code, out, err = finish(kvstore("ingest", short, "--address", d.address), timeout=180)
    assert code == 0, err
    assert f"{short}: " in out and "shorter than one chunk (256 tokens): nothing stored" in out
    with KVStoreClient(d.address) as client:
        assert client.stats()["tiers"]["cpu"]["blocks"] == 0
