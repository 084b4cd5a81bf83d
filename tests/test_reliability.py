"""Crashes, faults under a running daemon, a full disk, and load (docs/guarantees.md cites these)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from tests.test_daemon import BLOCK, NS, make_blocks

ROOT = Path(__file__).resolve().parent.parent


def test_kill_9_during_heavy_writes_loses_no_durable_block(daemon_factory):
    # The disk holds everything written here: durable means "survives a crash", and a full disk
    # would still evict (that is a cache's capacity, not a loss).
    d = daemon_factory(cpu_capacity="4MiB", disk_capacity="1GiB", disk_fsync="true", write_policy="write-through")
    acked: dict[bytes, bytes] = {}
    stop = threading.Event()
    lock = threading.Lock()

    def writer(seed: int) -> None:
        with KVStoreClient(d.address, timeout=10) as client:
            for round_ in range(250):  # at most 2,000 blocks of 295 KB: under the disk's 1 GiB
                if stop.is_set():
                    return
                keys, payloads = make_blocks(2, seed=1000 * seed + round_)
                try:
                    client.put(NS, [(keys[0], 64, payloads[0])], durable=True)
                    with lock:
                        acked[keys[0]] = payloads[0].tobytes()
                    client.put(NS, [(keys[1], 64, payloads[1])])  # not durable: may be lost
                except Exception:  # noqa: BLE001 - the daemon dies under us
                    return

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    time.sleep(4)
    d.stop(signal_kill=True)
    stop.set()
    for t in threads:
        t.join(30)
    assert len(acked) >= 10, "too few durable puts before the kill to mean anything"
    d.start()
    with KVStoreClient(d.address) as client:
        keys = list(acked)
        got = client.get(keys, BLOCK)
        lost = [k for k, g in zip(keys, got) if g is None]
        wrong = [k for k, g in zip(keys, got) if g is not None and g != acked[k]]
        assert not lost and not wrong, f"{len(lost)} durable blocks lost, {len(wrong)} wrong"
        assert client.stats()["tiers"]["disk"]["corrupt"] == 0  # no torn block file after the crash


def test_faults_under_a_running_daemon_are_counted_misses(daemon_factory):
    d = daemon_factory(cpu_capacity="1MiB", write_policy="write-back", promote_on_get="false")
    keys, payloads = make_blocks(12, seed=30)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.lookup(keys[:3]).tiers == ("disk",) * 3
        paths = [d.folder / "disk" / k.hex()[:2] / f"{k.hex()}.kvb" for k in keys[:3]]
        data = bytearray(paths[0].read_bytes())
        data[5000] ^= 0x80                                     # a flipped byte
        paths[0].write_bytes(bytes(data))
        paths[1].write_bytes(paths[1].read_bytes()[:-1000])     # a truncated file
        paths[2].unlink()                                      # a file deleted underneath
        got = client.get(keys[:4], BLOCK)
        assert got == [None, None, None, payloads[3].tobytes()]
        stats = client.stats()
        assert stats["tiers"]["disk"]["corrupt"] == 2 and stats["misses"] == 3
        assert client.lookup(keys[:3]).hits == 0


@pytest.fixture
def tiny_filesystem(short_tmp):
    mount = short_tmp / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_evicts_instead_of_crashing(daemon_factory, tiny_filesystem):
    # The disk tier believes it has 64 MiB; the filesystem under it holds 2 MiB (~13 blocks).
    d = daemon_factory(cpu_capacity="1MiB", disk_path=tiny_filesystem / "blocks", disk_capacity="64MiB",
                       write_policy="write-back", disk_fsync="false")
    # The daemon shrank its capacity to the free space at start; others then take half of it, so
    # the device fills before the tier's byte count says so (the ENOSPC path).
    (tiny_filesystem / "filler").write_bytes(b"\x5a" * (1 << 20))
    keys, payloads = make_blocks(40, seed=31)
    with KVStoreClient(d.address) as client:
        assert client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)]) == 40
        got = client.get(keys, BLOCK)
        present = [g for g in got if g is not None]
        assert 5 <= len(present) < 40
        assert all(g == p.tobytes() for g, p in zip(got, payloads) if g is not None)
        assert client.stats()["tiers"]["disk"]["evictions"] > 0
    assert d.alive


def test_sixteen_clients_under_load(short_tmp):
    out = short_tmp / "load.json"
    result = subprocess.run([sys.executable, "bench/load_test.py", "--clients", "16", "--seconds", "8",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["wrong_blocks"] == 0 and report["daemon_alive"]
    assert report["peak_anon"] <= report["anon_cap"]
    assert report["hit_rate"] > 0.3 and sum(report["evictions"].values()) > 0
