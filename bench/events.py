"""KV events: the daemon's Put throughput with and without a subscriber attached, and events per second.

Two daemons in the same run, CPU tier only, small blocks (16 KiB: the most events per byte, the worst
case for the publisher) and a tier small enough that every Put past the first few hundred also
evicts one block (a BlockStored and a BlockRemoved per Put):

- ``off``: no events_listen (the baseline: the store without the hook's publisher);
- ``events``: events_listen + events_replay, measured alternately with no subscriber and with one
  subscriber thread draining the stream as a router would (decoding every batch).

Each repeat puts ``--puts`` blocks one per call into each condition in turn; the ratios are taken
per repeat and summarized by the median.

    python bench/events.py [--puts 1000] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from kvstore.daemon.event_format import decode_batch  # noqa: E402
from kvstore.keys import KVLayout, Namespace, prefix_keys  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16")
CHUNK = 64
NAMESPACE = Namespace("bench-events", LAYOUT, chunk_tokens=CHUNK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Drain(threading.Thread):
    """A subscriber that reads and decodes every batch, counting events."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.events = self.batches = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                _, _, payload = self.sock.recv_multipart()
                self.events += len(decode_batch(payload).events)
                self.batches += 1
        self.sock.close()


def put_run(client: KVStoreClient, chain: tuple[list[bytes], list[int]], payload: np.ndarray) -> float:
    """Puts per second, one block per call, each with its parent and token ids as the engines send
    them (the daemon with events keeps both in the block's header and publishes them)."""
    keys, tokens = chain
    started = time.perf_counter()
    for i, key in enumerate(keys):
        client.put(NAMESPACE, [(key, CHUNK, payload, keys[i - 1] if i else b"", tokens[i * CHUNK : (i + 1) * CHUNK])])
    return len(keys) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--puts", type=int, default=1000, help="Puts per condition and repeat (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write every repeat's figures as JSON")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvs-bench-events-"))
    common = {"cpu_capacity": "4MiB", "disk_path": "", "log_level": "WARNING"}
    events_at, replay_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    payload = np.random.default_rng(0).standard_normal(LAYOUT.block_bytes(CHUNK) // 2).astype(np.float16)
    rng = np.random.default_rng(1)
    repeats = []
    with DaemonProcess.in_folder(folder / "off", **common) as off, \
            DaemonProcess.in_folder(folder / "events", events_listen=events_at, events_replay=replay_at,
                                    **common) as on, \
            KVStoreClient(off.address) as off_client, KVStoreClient(on.address) as on_client:
        def fresh_keys(puts: int = args.puts) -> tuple[list[bytes], list[int]]:
            tokens = rng.integers(0, 49152, size=puts * CHUNK).tolist()
            return prefix_keys(NAMESPACE, tokens), tokens

        put_run(off_client, fresh_keys(200), payload)  # warm up both
        put_run(on_client, fresh_keys(200), payload)
        for repeat in range(args.repeats):
            baseline = put_run(off_client, fresh_keys(), payload)
            alone = put_run(on_client, fresh_keys(), payload)
            drain = Drain(events_at)
            drain.start()
            time.sleep(0.3)  # the subscription reaches the publisher
            before = on_client.stats()["events_published"]
            started = time.perf_counter()
            subscribed = put_run(on_client, fresh_keys(), payload)
            after = on_client.stats()
            published_per_s = (after["events_published"] - before) / (time.perf_counter() - started)
            time.sleep(0.3)
            drain.stop.set()
            drain.join()
            row = {"repeat": repeat, "puts_per_s_events_off": round(baseline, 1),
                   "puts_per_s_no_subscriber": round(alone, 1), "puts_per_s_subscriber": round(subscribed, 1),
                   "ratio_subscriber_vs_none": round(subscribed / alone, 3),
                   "ratio_events_on_vs_off": round(alone / baseline, 3),
                   "events_published_per_s": round(published_per_s, 1),
                   "events_received": drain.events, "batches_received": drain.batches,
                   "events_dropped": after["events_dropped"]}
            repeats.append(row)
            print(json.dumps(row))
    summary = {key: statistics.median(r[key] for r in repeats)
               for key in ("puts_per_s_events_off", "puts_per_s_no_subscriber", "puts_per_s_subscriber",
                           "ratio_subscriber_vs_none", "ratio_events_on_vs_off", "events_published_per_s")}
    print(f"\nmedian of {args.repeats} repeats, {args.puts} Puts of one {LAYOUT.block_bytes(CHUNK) // 1024} KiB "
          f"block each per condition:")
    print(f"  Puts/s  events off {summary['puts_per_s_events_off']:.0f}   events on, no subscriber "
          f"{summary['puts_per_s_no_subscriber']:.0f}   with a subscriber {summary['puts_per_s_subscriber']:.0f}")
    print(f"  ratio   subscriber / none {summary['ratio_subscriber_vs_none']:.3f}   events on / off "
          f"{summary['ratio_events_on_vs_off']:.3f}")
    print(f"  events published per second (during the subscribed run) {summary['events_published_per_s']:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": repeats, "median": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
