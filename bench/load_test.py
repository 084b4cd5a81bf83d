"""Load test: many clients putting more than the tiers hold and reading a Zipf-skewed key set.

    python bench/load_test.py [--clients 16] [--seconds 60] [--json out.json]

A daemon (CPU tier and disk tier, both smaller than the data) runs as a subprocess; each client is
a process that, for the duration, picks a key from a Zipf distribution over its key space, Gets it,
and Puts it when missing (so the working set churns through eviction and demotion). Reported: Get
and Put rates, hit rates per tier, errors (must be 0), blocks that came back wrong (must be 0),
and the daemon's peak memory against its configured caps (sampled from /proc every 50 ms):

- anonymous memory (the CPU arena, Python, buffers) against ``cpu_capacity`` + a stated margin;
- shared memory mapped from the clients' arenas, which the daemon does not own, shown apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from kvstore.keys import KVLayout, Namespace, prefix_keys  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float16")
CHUNK = 64
BLOCK = LAYOUT.block_bytes(CHUNK)  # 256 KiB
MARGIN = 256 * 2**20


def payload_for(key: bytes) -> np.ndarray:
    """Deterministic content per key, so any client can check any block it reads."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 2**16, size=BLOCK // 2, dtype=np.uint16)


def client(args) -> dict:
    address, client_id, keys_per_client, seconds, zipf_a, start_at = args
    ns = Namespace("load", LAYOUT, chunk_tokens=CHUNK)
    # Key space shared by all clients (so blocks are hits across clients), Zipf-skewed popularity.
    keys = prefix_keys(ns, np.arange(keys_per_client * CHUNK) % 50000)
    rng = np.random.default_rng(client_id)
    stats = {"gets": 0, "hits": 0, "puts": 0, "errors": 0, "wrong": 0, "tiers": {}}
    with KVStoreClient(address, arena_bytes=8 * (BLOCK + 8192)) as kv:
        while time.time() < start_at:
            time.sleep(0.01)
        deadline = time.time() + seconds
        while time.time() < deadline:
            index = min(int(rng.zipf(zipf_a)) - 1, len(keys) - 1)
            key = keys[index]
            try:
                with kv.fetch([key], BLOCK) as (block,):
                    stats["gets"] += 1
                    if block is not None:
                        stats["hits"] += 1
                        stats["tiers"][block.tier] = stats["tiers"].get(block.tier, 0) + 1
                        if bytes(block.payload) != payload_for(key).tobytes():
                            stats["wrong"] += 1
                if block is None:
                    kv.put(ns, [(key, CHUNK, payload_for(key))])
                    stats["puts"] += 1
            except Exception:  # noqa: BLE001 - counted, the load goes on
                stats["errors"] += 1
    return stats


def memory_sampler(pid: int, peaks: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            return
        for name in ("VmRSS", "RssAnon", "RssShmem"):
            value = int(fields.get(name, "0 kB").split()[0]) * 1024
            peaks[name] = max(peaks.get(name, 0), value)
        stop.wait(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--keys", type=int, default=2000, help="key space in blocks (default 2000 x 256 KiB = 500 MiB)")
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of key popularity")
    parser.add_argument("--cpu-capacity", type=int, default=32 * 2**20, help="bytes (default 32 MiB)")
    parser.add_argument("--disk-capacity", type=int, default=96 * 2**20, help="bytes (default 96 MiB)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvl-"))
    daemon = DaemonProcess.in_folder(folder, cpu_capacity=args.cpu_capacity, disk_path=folder / "disk",
                                     disk_capacity=args.disk_capacity, disk_fsync="false", log_level="ERROR")
    address = daemon.address
    peaks: dict[str, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=memory_sampler, args=(daemon.proc.pid, peaks, stop), daemon=True)
    sampler.start()
    try:
        start_at = time.time() + 3.0
        with ProcessPoolExecutor(args.clients) as pool:
            results = list(pool.map(client, [(address, i, args.keys, args.seconds, args.zipf, start_at)
                                             for i in range(args.clients)]))
        with KVStoreClient(address, shared_memory=False) as kv:
            daemon_stats = kv.stats()
        alive = daemon.alive
    finally:
        stop.set()
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)

    total = {k: sum(r[k] for r in results) for k in ("gets", "hits", "puts", "errors", "wrong")}
    tiers: dict[str, int] = {}
    for r in results:
        for name, count in r["tiers"].items():
            tiers[name] = tiers.get(name, 0) + count
    data_bytes = args.keys * BLOCK
    cap = args.cpu_capacity + MARGIN
    report = {
        "clients": args.clients, "seconds": args.seconds, "key_space_bytes": data_bytes,
        "cpu_capacity": args.cpu_capacity, "disk_capacity": args.disk_capacity,
        "get_per_s": total["gets"] / args.seconds, "put_per_s": total["puts"] / args.seconds,
        "hit_rate": total["hits"] / max(total["gets"], 1),
        "hits_by_tier": {k: v / max(total["gets"], 1) for k, v in tiers.items()},
        "errors": total["errors"], "wrong_blocks": total["wrong"], "daemon_alive": alive,
        "peak_rss": peaks.get("VmRSS", 0), "peak_anon": peaks.get("RssAnon", 0),
        "peak_shmem": peaks.get("RssShmem", 0), "anon_cap": cap,
        "evictions": {name: t["evictions"] for name, t in daemon_stats["tiers"].items()},
        "queue_dropped": daemon_stats["queue_dropped"],
    }
    print(f"{args.clients} clients x {args.seconds:.0f} s, key space {data_bytes / 2**20:.0f} MiB "
          f"(Zipf {args.zipf}) over CPU {args.cpu_capacity / 2**20:.0f} MiB + disk {args.disk_capacity / 2**20:.0f} MiB")
    print(f"Get {report['get_per_s']:.0f}/s, Put {report['put_per_s']:.0f}/s, hit rate {report['hit_rate']:.1%} "
          f"({', '.join(f'{k} {v:.1%}' for k, v in report['hits_by_tier'].items())})")
    print(f"evictions {report['evictions']}, write-through copies dropped {report['queue_dropped']}")
    print(f"errors {report['errors']}, wrong blocks {report['wrong_blocks']}, daemon alive {alive}")
    print(f"daemon memory peak: anonymous {report['peak_anon'] / 2**20:.0f} MiB (cap: CPU tier "
          f"{args.cpu_capacity / 2**20:.0f} MiB + margin {MARGIN / 2**20:.0f} MiB = {cap / 2**20:.0f} MiB), "
          f"client arenas mapped {report['peak_shmem'] / 2**20:.0f} MiB, RSS {report['peak_rss'] / 2**20:.0f} MiB")
    ok = alive and not total["errors"] and not total["wrong"] and report["peak_anon"] <= cap
    print("PASS" if ok else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
