"""Daemon throughput: Put/Get GB/s over shared memory and inline gRPC, against same-run baselines.

Blocks are the size of one 256-token SmolLM2-135M chunk: 30 layers x 2 x 3 kv heads x 256 tokens x
64 x 2 bytes = 5.9 MB. Baselines are measured in the same run on the same bytes:

- CPU tier: numpy memcpy of the same blocks (the ceiling for any copy into the client's memory);
- disk tier: plain ``write``/``read`` of the same bytes as files in the same folder;
- remote client (no shared memory, the daemon's data channel on TCP loopback): a plain TCP socket
  on loopback, one thread ``sendall``-ing the same bytes and the other ``recv_into``-ing them into
  one buffer, measured in rounds alternating with the client's Puts and Gets.

Transports: ``shm`` is a client that copies each payload into its staging arena, whence the
daemon copies it (two copies for a Put); ``rows`` is a Put from a KV cache in shared memory
(engine_adapter/client/shared_kv.py), which the daemon copies out of in rows (one copy: what the
reference engine and the transformers adapter do); ``inline`` carries payloads in gRPC messages.

Disk reads of both the daemon and the baseline come from the page cache (the files were just
written); ``--o-direct`` makes the daemon bypass it (the baseline then uses O_DIRECT too).

``--encrypt`` measures what ``disk_encrypt`` costs instead: two daemons, one sealing its disk
blocks (tiers/at_rest.py) and one not, each Put the same blocks, then Get them in rounds that
alternate between the two (plain, sealed, sealed, plain, ...); it prints each side's median and the
ratio sealed / plain, per round and overall.

    python bench/daemon_throughput.py [--blocks 48] [--batch 8] [--json out.json] [--remote-only]
    python bench/daemon_throughput.py --encrypt [--rounds 8] [--o-direct]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import threading
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon_clients import (  # noqa: E402  (the blocks and one client's work)
    BLOCK, CHUNK, blocks_for, client_get, client_put, client_put_rows, keys_for, lookup_latencies,
    lookups_during_puts, namespace, run_clients)
from bench.daemon_clients import KVStoreClient  # noqa: E402  (either revision's: bench/ab_pairs.py)
from kvstore.spawn import DaemonProcess  # noqa: E402


def start_daemon(folder: Path, **settings) -> tuple[DaemonProcess, str]:
    daemon = DaemonProcess.in_folder(folder, **settings)
    return daemon, daemon.address


def stop_daemon(daemon: DaemonProcess) -> None:
    daemon.stop()


# -- baselines ---------------------------------------------------------------------------------------


def destinations(slots: int) -> np.ndarray:
    """``slots`` block-sized destinations in one prefaulted buffer, as a client arena is."""
    buffer = np.ones(slots * BLOCK, dtype=np.uint8)  # written once: every page is faulted in
    return buffer.reshape(slots, BLOCK)


def memcpy_gbps(n: int, slots: int) -> float:
    """memcpy of the same blocks into ``slots`` rotating destinations (1: one cache-hot buffer)."""
    _, payloads = blocks_for(0, n)
    dest = destinations(slots)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for i, p in enumerate(payloads):
            np.copyto(dest[i % slots], p.view(np.uint8))
        best = max(best, n * BLOCK / (time.perf_counter() - start) / 1e9)
    return best


def file_gbps(folder: Path, n: int, o_direct: bool, slots: int) -> tuple[float, dict[int, float]]:
    """Plain write of the blocks as files, then plain reads into 1 and ``slots`` destinations."""
    _, payloads = blocks_for(0, n)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i}.bin" for i in range(n)]
    start = time.perf_counter()
    for path, p in zip(paths, payloads):
        with open(path, "wb") as f:
            f.write(p.view(np.uint8).data)
    write = n * BLOCK / (time.perf_counter() - start) / 1e9
    reads = {}
    for count in sorted({1, slots}):
        if o_direct:
            padded = (BLOCK + 4095) // 4096 * 4096
            buffers = [mmap.mmap(-1, padded) for _ in range(count)]
            start = time.perf_counter()
            for i, path in enumerate(paths):
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                os.preadv(fd, [buffers[i % count]], 0)
                os.close(fd)
        else:
            dest = destinations(count)
            start = time.perf_counter()
            for i, path in enumerate(paths):
                with open(path, "rb", buffering=0) as f:
                    f.readinto(memoryview(dest[i % count]))
        reads[count] = n * BLOCK / (time.perf_counter() - start) / 1e9
    return write, reads


def interleaved_disk_rounds(address: str, block_dir: Path, client_id: int, n: int, batch: int,
                            rounds: int, o_direct: bool) -> dict:
    """Median Get GB/s and median plain-read GB/s of the same block files, measured alternately."""
    keys = keys_for(client_id, n)
    # the disk tier's file names (tiers.disk.block_path), spelled out: bench/ab_pairs.py runs this
    # file against older revisions, so it uses no helper they may lack
    paths = [block_dir / k.hex()[:2] / f"{k.hex()}.kvb" for k in keys]
    dest = destinations(batch)
    gets, reads = [], []
    with KVStoreClient(address, arena_bytes=(batch + 2) * (BLOCK + 8192) * 2) as client:
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(0, n, batch):
                with client.fetch(keys[i:i + batch], BLOCK):
                    pass
            gets.append(n * BLOCK / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for i, path in enumerate(paths):
                flags = os.O_RDONLY | (os.O_DIRECT if o_direct else 0)
                fd = os.open(path, flags)
                try:
                    if o_direct:
                        buffer = mmap.mmap(-1, (path.stat().st_size + 4095) // 4096 * 4096)
                        os.preadv(fd, [buffer], 0)
                        buffer.close()
                    else:
                        os.readv(fd, [memoryview(dest[i % batch])])
                finally:
                    os.close(fd)
            reads.append(n * BLOCK / (time.perf_counter() - start) / 1e9)
    get, read = statistics.median(gets), statistics.median(reads)
    return {"get": get, "read": read, "ratio": get / read}


def encrypted_disk_rounds(scratch: Path, n: int, batch: int, rounds: int, o_direct: bool) -> dict:
    """Disk-tier Put and Get GB/s of a daemon with ``disk_encrypt`` against one without, on the
    same blocks: one Put pass each, then ``rounds`` Get passes each, alternating ABBA."""
    daemons: dict[str, tuple[DaemonProcess, str]] = {}
    puts: dict[str, float] = {}
    gets: dict[str, list[float]] = {"plain": [], "sealed": []}
    try:
        for side in ("plain", "sealed"):
            folder = scratch / f"disk-{side}"
            folder.mkdir()
            daemons[side] = start_daemon(folder, cpu_capacity=0, disk_path=folder / "blocks",
                                         disk_capacity=n * BLOCK * 4, disk_fsync="false",
                                         disk_o_direct=str(o_direct).lower(), disk_encrypt=str(side == "sealed").lower())
        for side, (_, address) in daemons.items():
            puts[side] = run_clients(client_put, 1, lambda i, t: (address, 700, n, True, batch, t))
        for r in range(rounds):
            order = ("plain", "sealed") if r % 2 == 0 else ("sealed", "plain")
            for side in order:
                address = daemons[side][1]
                gets[side].append(run_clients(client_get, 1, lambda i, t: (address, 700, n, True, batch, t, 1)))
    finally:
        for proc, _ in daemons.values():
            stop_daemon(proc)
    per_round = [s / p for s, p in zip(gets["sealed"], gets["plain"])]
    plain, sealed = statistics.median(gets["plain"]), statistics.median(gets["sealed"])
    return {"put_plain": puts["plain"], "put_sealed": puts["sealed"], "put_ratio": puts["sealed"] / puts["plain"],
            "get_plain": plain, "get_sealed": sealed, "get_ratio": sealed / plain,
            "get_ratio_per_round": per_round, "get_plain_rounds": gets["plain"], "get_sealed_rounds": gets["sealed"]}


# -- remote client: the data channel against a plain TCP socket ------------------------------------


def socket_gbps(nbytes: int, chunk: int) -> float:
    """A plain loopback TCP socket: a thread sendall-s ``nbytes`` in ``chunk``-byte calls, this
    thread recv_into-s them into one prefaulted buffer of ``chunk`` bytes."""
    source = np.random.default_rng(1).integers(1, 256, chunk, dtype=np.uint8)
    sink = memoryview(np.ones(chunk, dtype=np.uint8))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()

    def send() -> None:
        with sender:
            for at in range(0, nbytes, chunk):
                sender.sendall(memoryview(source)[: min(chunk, nbytes - at)])

    with receiver:
        start = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        got = 0
        while got < nbytes:
            n = receiver.recv_into(sink)
            if not n:
                break
            got += n
        thread.join()
        elapsed = time.perf_counter() - start
    if got != nbytes:
        raise RuntimeError(f"the socket baseline moved {got} of {nbytes} bytes")
    return nbytes / elapsed / 1e9


def remote_rounds(address: str, token: str, n: int, batch: int, rounds: int, passes: int) -> list[dict]:
    """Per round: the socket baseline, a remote client's Put of ``n`` new blocks, its Gets of them
    (``passes``), each in GB/s; the blocks are deleted after the round (untimed)."""
    out = []
    with KVStoreClient(address, token=token, shared_memory=False) as client:
        if not client.data_channel:
            raise RuntimeError(f"{address} offers no data channel")
        for r in range(rounds):
            keys, payloads = blocks_for(700 + r, n)
            ns = namespace(700 + r)
            baseline = socket_gbps(n * BLOCK, batch * BLOCK)
            start = time.perf_counter()
            for i in range(0, n, batch):
                client.put(ns, [(k, CHUNK, p) for k, p in zip(keys[i:i + batch], payloads[i:i + batch])])
            put = n * BLOCK / (time.perf_counter() - start) / 1e9
            start = time.perf_counter()
            for _ in range(passes):
                for i in range(0, n, batch):
                    with client.fetch(keys[i:i + batch], BLOCK) as fetched:
                        if any(b is None for b in fetched):
                            raise RuntimeError("blocks missing from the remote Get")
            get = passes * n * BLOCK / (time.perf_counter() - start) / 1e9
            client.delete(keys)
            out.append({"round": r, "socket_gbps": baseline, "put_gbps": put, "get_gbps": get,
                        "put_ratio": put / baseline, "get_ratio": get / baseline})
            print(f"remote round {r}: socket {baseline:.2f} GB/s, put {put:.2f} ({put / baseline:.2f}x), "
                  f"get {get:.2f} ({get / baseline:.2f}x)", flush=True)
    return out


def remote_rows(scratch: Path, n: int, batch: int, rounds: int, passes: int) -> tuple[list[dict], list[dict]]:
    """A daemon on TCP loopback with a data channel; a client without shared memory."""
    token = "bench-token-0123456789"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (scratch / "remote-run").mkdir()
    cpu_bytes = 2 * n * (BLOCK + 8192)
    daemon = DaemonProcess({"listen": f"127.0.0.1:{port}", "auth_token": token, "data_listen": "127.0.0.1:0",
                            "cpu_capacity": cpu_bytes, "disk_path": "", "log_level": "WARNING"},
                           log_path=scratch / "remote-run" / "daemon.log").start()
    time.sleep(cpu_bytes / 250e6)  # the arena's prefault (see above)
    try:
        per_round = remote_rounds(f"127.0.0.1:{port}", token, n, batch, rounds, passes)
    finally:
        stop_daemon(daemon)
    rows = []
    for op in ("put", "get"):
        rows.append(dict(tier="cpu", transport="data", clients=1, op=op,
                         gbps=statistics.median(r[f"{op}_gbps"] for r in per_round), baseline="tcp socket",
                         ratio=statistics.median(r[f"{op}_ratio"] for r in per_round),
                         ratio_slots=statistics.median(r[f"{op}_ratio"] for r in per_round)))
    return rows, per_round


# -- main --------------------------------------------------------------------------------------------


class _Done(Exception):
    """--remote-only: the rest of the run is skipped."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48, help="blocks per client (default 48 = 283 MB)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per Put/Get call (default 8)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="client counts (default 1 8)")
    parser.add_argument("--lookup-calls", type=int, default=400, help="Lookups per client for latency")
    parser.add_argument("--get-passes", type=int, default=3, help="timed passes over its blocks per CPU-tier Get client "
                        "(after one untimed pass; default 3)")
    parser.add_argument("--o-direct", action="store_true", help="disk reads bypass the page cache")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds for the paired disk Get (default 7)")
    parser.add_argument("--folder", default=None, help="scratch folder on the disk to test (default: a temp dir)")
    parser.add_argument("--remote-rounds", type=int, default=5,
                        help="alternating rounds of the socket baseline and a remote client's Put and Get "
                             "(default 5; 0: none, e.g. against a revision without the data channel)")
    parser.add_argument("--remote-only", action="store_true", help="only the remote client against the socket")
    parser.add_argument("--loaded-lookups", type=int, default=1000, metavar="N",
                        help="paced gRPC Lookups of one client alone and then during another client's Puts in "
                             "rows (default 1000; 0: none)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--encrypt", action="store_true",
                        help="only the disk tier, sealed (disk_encrypt) against plain, in alternating rounds")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="kvb-", dir=args.folder))
    rows: list[dict] = []
    lookups: dict = {}
    remote: list[dict] = []
    mem: dict = {}
    file_write, file_read = 0.0, {}
    try:
        n, batch = args.blocks, args.batch
        if args.encrypt:
            enc = encrypted_disk_rounds(scratch, n, batch, args.rounds, args.o_direct)
            print(f"disk tier, {n} blocks of {BLOCK / 1e6:.2f} MB, batch {batch}, {args.rounds} alternating rounds"
                  f"{' (O_DIRECT)' if args.o_direct else ' (page cache)'}")
            print(f"put (one pass each): plain {enc['put_plain']:.2f} GB/s, encrypted {enc['put_sealed']:.2f} GB/s, "
                  f"ratio {enc['put_ratio']:.2f}")
            print(f"get (median of rounds): plain {enc['get_plain']:.2f} GB/s, encrypted {enc['get_sealed']:.2f} GB/s, "
                  f"ratio {enc['get_ratio']:.2f} (per round: "
                  + ", ".join(f"{r:.2f}" for r in enc["get_ratio_per_round"]) + ")")
            if args.json:
                Path(args.json).write_text(json.dumps({"block_bytes": BLOCK, "batch": batch, "blocks": n,
                                                       "o_direct": args.o_direct, "encrypt": enc}, indent=2))
            return 0
        # Remote client (no shared memory): the data channel against a plain TCP socket, alternating.
        if args.remote_rounds > 0:
            remote_figures, remote = remote_rows(scratch, n, batch, args.remote_rounds, args.get_passes)
            rows += remote_figures
        if args.remote_only:
            raise _Done
        per_client = {c: max(batch, n // c) for c in args.clients}
        # Baselines copy into one cache-hot buffer ("hot") and, like a Get, into `batch` distinct
        # destinations of a prefaulted buffer ("slots"); ratios are given against both.
        mem = {"hot": memcpy_gbps(n, 1), "slots": memcpy_gbps(n, batch)}
        file_write, reads = file_gbps(scratch / "baseline", n, args.o_direct, batch)
        file_read = {"hot": reads[1], "slots": reads[batch]}
        print(f"block {BLOCK / 1e6:.2f} MB, batch {batch}, {n} blocks per run; baselines: memcpy {mem['hot']:.2f} GB/s "
              f"hot / {mem['slots']:.2f} GB/s into {batch} slots, file write {file_write:.2f} GB/s, file read "
              f"{file_read['hot']:.2f} hot / {file_read['slots']:.2f} GB/s into {batch} slots"
              f"{' (O_DIRECT)' if args.o_direct else ' (page cache)'}")

        # CPU tier: a daemon whose CPU tier holds everything.
        try:  # older revisions (bench/ab_pairs.py) have no Puts in rows
            try:
                from engine_adapter.client.kvstore_client import KVStoreClient as _rows  # noqa: F401
            except ImportError:
                from engine_adapter.shared_kv import put_rows  # noqa: F401
            puts_in_rows = True
        except ImportError:
            puts_in_rows = False
        cpu_bytes = max(per_client[c] * c for c in args.clients) * (BLOCK + 8192) * (3 if puts_in_rows else 2)
        (scratch / "cpu-run").mkdir()
        proc, address = start_daemon(scratch / "cpu-run", cpu_capacity=cpu_bytes, disk_path="")
        time.sleep(cpu_bytes / 250e6)  # let the arena finish faulting in (slow on VMs; see kvstore/memory.py)
        try:
            for shm in (True, False):
                transport = "shm" if shm else "inline"
                for clients in args.clients:
                    m = per_client[clients]
                    # Distinct client ids per (transport, clients) so every Put stores new blocks.
                    base = (0 if shm else 100) + clients * 10
                    put = run_clients(client_put, clients, lambda i, t: (address, base + i, m, shm, batch, t))
                    get = run_clients(client_get, clients,
                                      lambda i, t: (address, base + i, m, shm, batch, t, args.get_passes))
                    figures = [("put", put), ("get", get)]
                    if shm and puts_in_rows:
                        # the same Puts from a KV cache in shared memory: one copy, the daemon's
                        figures.append(("put", run_clients(client_put_rows, clients,
                                                           lambda i, t: (address, base + 300 + i, m, batch, t))))
                    for (op, gbps), kind in zip(figures, (transport, transport, "rows")):
                        rows.append(dict(tier="cpu", transport=kind, clients=clients, op=op, gbps=gbps,
                                         baseline="memcpy", ratio=gbps / mem["hot"],
                                         ratio_slots=gbps / mem["slots"]))
            # Lookup latency with 8 concurrent clients, 32 keys per call (an 8k-token prompt):
            # paced at one call per client every 5 ms (1,600 Lookups/s in all), and back to back;
            # same-host clients (the default: answered from the shared key index) and over gRPC.
            lookups = {f"{kind} {mode}": lookup_latencies(address, 8, args.lookup_calls, interval, kind == "local")
                       for kind in ("local", "grpc") for mode, interval in (("paced", 0.005), ("back-to-back", 0.0))}
            if puts_in_rows and args.loaded_lookups:
                # What a large Put costs others: one client's gRPC Lookups (every 2 ms) alone, then
                # while another client Puts in rows, 47 MB calls back to back (lasting past them).
                lookups.update(lookups_during_puts(address, args.loaded_lookups, 0.002,
                                                   args.loaded_lookups * batch // 2, batch))
        finally:
            stop_daemon(proc)

        # Disk tier alone (no CPU tier): every Get is a disk read, checksum verified.
        (scratch / "disk-run").mkdir()
        proc, address = start_daemon(scratch / "disk-run", cpu_capacity=0, disk_path=scratch / "disk-run" / "blocks",
                                     disk_capacity=n * BLOCK * 4, disk_fsync="false",
                                     disk_o_direct=str(args.o_direct).lower())
        try:
            put = run_clients(client_put, 1, lambda i, t: (address, 500, n, True, batch, t))
            get = run_clients(client_get, 1, lambda i, t: (address, 500, n, True, batch, t, 1))
            rows.append(dict(tier="disk", transport="shm", clients=1, op="put", gbps=put,
                             baseline="file write", ratio=put / file_write, ratio_slots=put / file_write))
            rows.append(dict(tier="disk", transport="shm", clients=1, op="get", gbps=get,
                             baseline="file read", ratio=get / file_read["hot"],
                             ratio_slots=get / file_read["slots"]))
            # The same comparison, interleaved: rounds of Gets alternate with rounds of plain reads
            # of the daemon's own block files into `batch` slots, so both see the same machine.
            paired = interleaved_disk_rounds(address, scratch / "disk-run" / "blocks", 500, n, batch,
                                             args.rounds, args.o_direct)
            rows.append(dict(tier="disk", transport="shm", clients=1, op="get*", gbps=paired["get"],
                             baseline="same files", ratio=paired["ratio"], ratio_slots=paired["ratio"]))
        finally:
            stop_daemon(proc)
    except _Done:
        pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\n{'tier':<5} {'transport':<9} {'clients':>7} {'op':<4} {'GB/s':>7} {'baseline':<11} "
          f"{'vs hot':>7} {'vs slots':>8}")
    print("(get*: medians of alternating rounds against plain reads of the daemon's own block files; data: a "
          "remote client on the data channel, medians of rounds alternating with a plain TCP socket; rows: Puts "
          "from a KV cache in shared memory, one copy)")
    for r in rows:
        print(f"{r['tier']:<5} {r['transport']:<9} {r['clients']:>7} {r['op']:<4} {r['gbps']:>7.2f} "
              f"{r['baseline']:<11} {r['ratio']:>7.2f} {r['ratio_slots']:>8.2f}")
    for mode, lk in lookups.items():
        fallbacks = f", {lk['rpc_fallbacks']} answered over gRPC" if mode.startswith("local") else ""
        puts = f"; the Puts meanwhile {lk['put_gbps']:.2f} GB/s" if "put_gbps" in lk else ""
        print(f"Lookup, 32 keys, {mode if ', ' in mode else '8 clients ' + mode:<36} ({lk['calls']} calls{fallbacks}): "
              f"p50 {lk['p50']:.3f} ms, p99 {lk['p99']:.3f} ms{puts}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "block_bytes": BLOCK, "batch": batch, "blocks": n,
            "baselines": {"memcpy_gbps": mem, "file_write_gbps": file_write, "file_read_gbps": file_read,
                          "o_direct": args.o_direct},
            "rows": rows, "lookup_ms": lookups, "remote_rounds": remote}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
