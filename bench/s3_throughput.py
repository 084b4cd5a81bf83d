"""S3 tier throughput against plain boto3, and TTFT of a 4k-token prefix served from S3.

Everything runs against one moto S3 server on 127.0.0.1 started here (real HTTP). Blocks are the
size of one 256-token SmolLM2-135M chunk in fp16 (30 layers x 2 x 3 kv heads x 256 tokens x 64 x 2
bytes = 5.9 MB).

1. Throughput, with 1 and 8 concurrent requests (threads), same bytes, same endpoint, same run:
   - baseline: a default boto3 client's ``put_object`` of the block's bytes / ``get_object().read()``;
   - S3 tier: ``S3Tier.put`` / ``S3Tier.read_payload_into`` (streams into a preallocated buffer,
     compares the header, verifies the xxh3 payload checksum).
   Rounds alternate baseline and tier so shared-machine noise falls on both; the median round is
   kept. Ratio = tier GB/s / baseline GB/s.
2. TTFT, SmolLM2-135M-Instruct fp32 on CPU, a 4096-token document prompt plus a question:
   - cold: full prefill (``CachedEngine.generate(use_cache=False)``);
   - s3: a daemon with only an S3 tier (``--cpu-capacity 0 --disk-path '' --s3-bucket ...``), every
     context chunk loaded from S3 and only the question prefilled.

Targets: Get >= 0.8x plain boto3 at equal concurrency; 4k prefix from S3 >= 5x faster than cold.
With ``--encrypt``, a third side runs in the same rounds: the S3 tier sealing its objects
(``s3_encrypt``, tiers/at_rest.py), its ratio given against the plain tier's (encrypted / plain).

    python bench/s3_throughput.py [--rounds 5] [--context 4096] [--repeats 3] [--json out.json]
    python bench/s3_throughput.py --encrypt --skip-ttft
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kvstore.block import BlockHeader, payload_checksum  # noqa: E402
from kvstore.keys import KEY_BYTES, KVLayout  # noqa: E402

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
CHUNK = 256
BLOCK = LAYOUT.block_bytes(CHUNK)
BUCKET = "kvstore-bench"


def start_moto(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(folder / "moto.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not start")


def make_blocks(n: int) -> list[tuple[BlockHeader, memoryview]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        payload = memoryview(rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
        header = BlockHeader(key=rng.bytes(KEY_BYTES), namespace=b"b" * KEY_BYTES, layout=LAYOUT, tokens=CHUNK,
                             payload_len=BLOCK, checksum=payload_checksum(payload))
        out.append((header, payload))
    return out


def timed(concurrency: int, ops: list, fn) -> float:
    """Run ``fn(op)`` for every op on ``concurrency`` threads; returns seconds."""
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        list(pool.map(fn, ops))
        return time.perf_counter() - start


def throughput(endpoint: str, rounds: int, encrypt: bool = False) -> list[dict]:
    import boto3
    from botocore.config import Config

    from tiers.s3 import S3Config, S3Tier

    plain = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                         config=Config(max_pool_connections=20))
    tier = S3Tier(S3Config(bucket=BUCKET, endpoint_url=endpoint, prefix="tier"), list_on_start=False)
    sealed = None
    if encrypt:
        from tiers.at_rest import AtRestKey

        sealed = S3Tier(S3Config(bucket=BUCKET, endpoint_url=endpoint, prefix="sealed"), list_on_start=False,
                        at_rest=AtRestKey(os.urandom(32)))
    blocks = make_blocks(8)
    bodies = [h.pack() + bytes(p) for h, p in blocks]
    for i, body in enumerate(bodies):  # objects the Get rounds read
        plain.put_object(Bucket=BUCKET, Key=f"plain/{i}", Body=body)
        tier.put(*blocks[i])
        if sealed is not None:
            sealed.put(*blocks[i])
    dests = [memoryview(bytearray(BLOCK)) for _ in blocks]
    sealed_dests = [memoryview(bytearray(BLOCK)) for _ in blocks]
    rows = []
    for concurrency in (1, 8):
        ops = list(range(8 if concurrency == 1 else 24))  # op i touches block i % 8
        nbytes = len(ops) * len(bodies[0])
        sides = ("plain_put", "tier_put", "sealed_put", "plain_get", "tier_get", "sealed_get")
        samples: dict[str, list[float]] = {k: [] for k in sides if sealed is not None or "sealed" not in k}

        def plain_put(i):
            plain.put_object(Bucket=BUCKET, Key=f"plain/{i % 8}", Body=bodies[i % 8])

        def tier_put(i):
            tier.put(*blocks[i % 8])

        def plain_get(i):
            body = plain.get_object(Bucket=BUCKET, Key=f"plain/{i % 8}")["Body"].read()
            assert len(body) == len(bodies[0])

        def tier_get(i):
            tier.read_payload_into(blocks[i % 8][0].key, dests[i % 8])

        def sealed_put(i):
            sealed.put(*blocks[i % 8])

        def sealed_get(i):
            sealed.read_payload_into(blocks[i % 8][0].key, sealed_dests[i % 8])

        fns = {"plain_put": plain_put, "tier_put": tier_put, "sealed_put": sealed_put,
               "plain_get": plain_get, "tier_get": tier_get, "sealed_get": sealed_get}
        for r in range(rounds + 1):  # round 0 warms connections up, untimed
            names = list(samples) if r % 2 else list(reversed(samples))  # each pair in both orders
            for name in names:
                seconds = timed(concurrency, ops, fns[name])
                if r:
                    samples[name].append(nbytes / seconds / 1e9)
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append({"concurrency": concurrency, "requests": len(ops), "object_bytes": len(bodies[0]),
                     **{f"{k}_gbps": v for k, v in med.items()},
                     "put_ratio": med["tier_put"] / med["plain_put"], "get_ratio": med["tier_get"] / med["plain_get"]})
        if sealed is not None:
            rows[-1].update(sealed_put_ratio=med["sealed_put"] / med["tier_put"],
                            sealed_get_ratio=med["sealed_get"] / med["tier_get"])
    assert all(bytes(d) == bytes(p) for d, (_, p) in zip(dests, blocks))
    if sealed is not None:
        assert all(bytes(d) == bytes(p) for d, (_, p) in zip(sealed_dests, blocks))
        sealed.close()
    tier.close()
    return rows


def ttft(endpoint: str, folder: Path, context: int, repeats: int, threads: int) -> dict:
    import torch

    from engine_adapter.cached import CachedEngine
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.reference.prompts import document_prompt
    from kvstore.keys import prefix_keys
    from bench.warm_prefix import load_corpus, run_engine, start_daemon, stop_daemon, store_context

    torch.set_num_threads(threads)
    model, tokenizer = load_gguf(find_smollm2_gguf(), dtype=torch.float32)
    corpus = load_corpus(tokenizer, context + 64)
    full_context, _ = document_prompt(tokenizer, corpus.document, corpus.questions[0])
    full_context = full_context[:context]
    questions = [document_prompt(tokenizer, corpus.document, f"{corpus.questions[0]} ({i})")[1]
                 for i in range(repeats + 1)]
    proc, address = start_daemon(folder / "daemon", cpu_capacity=0, disk_path="", s3_bucket=BUCKET,
                                 s3_endpoint=endpoint, s3_prefix="ttft")
    try:
        with KVStoreClient(address) as client:
            engine = CachedEngine(model, tokenizer, client)
            kv = model.new_cache(len(full_context))
            with torch.inference_mode():
                model(torch.tensor(full_context, dtype=torch.long), kv, 0, last_only=True)
            keys = prefix_keys(engine.namespace, full_context)
            store_context(client, engine, keys, kv, "s3")
            del kv
            run_engine(engine, full_context, questions[0], use_cache=True, expect_tier="s3")  # warm-up
            cold, warm = [], []
            for q in questions[1:]:
                cold.append(run_engine(engine, full_context, q, use_cache=False, expect_tier=None))
                warm.append(run_engine(engine, full_context, q, use_cache=True, expect_tier="s3"))
            stats = client.stats()
    finally:
        stop_daemon(proc)
    cold_s = statistics.median(r.ttft_s for r in cold)
    warm_s = statistics.median(r.ttft_s for r in warm)
    return {"context_tokens": len(full_context), "chunks": len(keys), "repeats": repeats,
            "cold_ttft_s": cold_s, "s3_ttft_s": warm_s, "s3_load_s": statistics.median(r.load_s for r in warm),
            "speedup": cold_s / warm_s, "s3_hits": stats["tiers"]["s3"]["hits"], "misses": stats["misses"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed throughput rounds; the median is kept")
    parser.add_argument("--context", type=int, default=4096, help="prefix tokens for the TTFT part")
    parser.add_argument("--repeats", type=int, default=3, help="timed TTFT runs per mode; the median is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see bench/prefix_reuse.py)")
    parser.add_argument("--skip-ttft", action="store_true", help="throughput only (no model)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--encrypt", action="store_true",
                        help="also the S3 tier sealing its objects (s3_encrypt), against the plain tier")
    args = parser.parse_args()
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(name, value)

    folder = Path(tempfile.mkdtemp(prefix="kvb-s3-"))
    moto, endpoint = start_moto(folder)
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        rows = throughput(endpoint, args.rounds, args.encrypt)
        prefix = None if args.skip_ttft else ttft(endpoint, folder, args.context, args.repeats, args.threads)
    finally:
        moto.kill()
        moto.wait()

    print(f"S3 tier vs plain boto3 on moto at 127.0.0.1 ({rows[0]['object_bytes'] / 1e6:.1f} MB objects, "
          f"median of {args.rounds} rounds, GB/s)")
    print(f"{'conc':>4} {'reqs':>4} | {'plain put':>9} {'tier put':>9} {'ratio':>6} | "
          f"{'plain get':>9} {'tier get':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['requests']:>4} | {r['plain_put_gbps']:>9.3f} {r['tier_put_gbps']:>9.3f} "
              f"{r['put_ratio']:>5.2f}x | {r['plain_get_gbps']:>9.3f} {r['tier_get_gbps']:>9.3f} {r['get_ratio']:>5.2f}x")
    for r in rows:
        if "sealed_get_ratio" in r:
            print(f"  encrypted tier, concurrency {r['concurrency']}: put {r['sealed_put_gbps']:.3f} GB/s "
                  f"({r['sealed_put_ratio']:.2f}x the plain tier), get {r['sealed_get_gbps']:.3f} GB/s "
                  f"({r['sealed_get_ratio']:.2f}x the plain tier)")
    targets = [{"target": f"Get >= 0.8x plain boto3 at concurrency {r['concurrency']}", "value": r["get_ratio"],
                "met": r["get_ratio"] >= 0.8} for r in rows]
    if prefix:
        print(f"\nTTFT, SmolLM2-135M fp32 CPU, {prefix['context_tokens']}-token prefix ({prefix['chunks']} chunks), "
              f"median of {prefix['repeats']}")
        print(f"  cold prefill   {prefix['cold_ttft_s']:8.3f} s")
        print(f"  from S3        {prefix['s3_ttft_s']:8.3f} s  (load {prefix['s3_load_s']:.3f} s)  "
              f"{prefix['speedup']:.1f}x faster")
        targets.append({"target": "4k prefix from S3 >= 5x faster than cold prefill", "value": prefix["speedup"],
                        "met": prefix["speedup"] >= 5})
    print()
    for t in targets:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"throughput": rows, "ttft": prefix, "targets": targets}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
