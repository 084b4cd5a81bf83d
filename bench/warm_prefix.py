"""A stored prefix and a warm run on it: the parts `bench/prefix_reuse.py` and `bench/s3_throughput.py`
time TTFT with, and `bench/codec_disk.py` stores blocks with.

- the document: `load_corpus`, the sample document extended with MuSiQue dev passages to a length;
- daemons: `start_daemon` / `stop_daemon`;
- storing a context: `put_chunks` (chunk c of a KV cache under key c), `wait_in_tier` (until Lookup
  finds every key in one tier), `store_context` (both);
- ceilings: `memcpy_gbps`, `o_direct_read_gbps` (the disk tier's read with ``--disk-o-direct true``);
- one timed run: `run_engine`, a `CachedEngine.generate` of one token, checked to reuse the whole
  context from the expected tier when the cache is used.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.musique import MUSIQUE_DEV
from engine_adapter.cached import CachedEngine
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.kv_cache import KVCache
from kvstore.spawn import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "engine_adapter" / "data" / "musique_sample.json"


# -- the document and the questions ------------------------------------------------------------------


@dataclass
class Corpus:
    document: str
    questions: list[str]
    source: str


def load_corpus(tokenizer, min_tokens: int) -> Corpus:
    """The sample document, extended with MuSiQue dev passages (or repeated) to ``min_tokens`` tokens.

    Passages are joined with blank lines, as the sample's own 10 passages are.
    """
    sample = json.loads(SAMPLE.read_text())
    passages = [sample["document"]]
    questions = [q["question"] for q in sample["questions"]]
    source = f"{SAMPLE.relative_to(ROOT)} (MuSiQue dev question 0, 10 passages)"
    extra: list[str] = []
    if MUSIQUE_DEV.is_file():
        dev = json.loads(MUSIQUE_DEV.read_text())
        # dev[0] is the sample's own question: its passages are already in.
        extra = [p["text"] for item in dev[1:] for p in item["ctxs"]]
        questions += [item["question"] for item in dev[1:]]
    used = 0
    while len(tokenizer.encode("\n\n".join(passages))) < min_tokens:
        if used < len(extra):
            passages += extra[used : used + 20]
            used += 20
        else:
            passages.append(sample["document"])  # no dev set: repeat the sample
    if used:
        source += f" + {min(used, len(extra))} passages of MuSiQue dev questions 1.. ({MUSIQUE_DEV.name})"
    elif len(passages) > 1:
        source += f", repeated {len(passages)} times"
    return Corpus("\n\n".join(passages), questions, source)


# -- daemons -------------------------------------------------------------------------------------------


def start_daemon(folder: Path, **settings) -> tuple[DaemonProcess, str]:
    daemon = DaemonProcess.in_folder(folder, **settings)
    return daemon, daemon.address


def stop_daemon(daemon: DaemonProcess) -> None:
    daemon.stop()


def store_context(client: KVStoreClient, engine: CachedEngine, keys: list[bytes], kv: KVCache,
                  expect_tier: str, timeout_s: float = 120.0) -> None:
    """Put every chunk of ``kv`` under ``keys`` and wait until all are in ``expect_tier``."""
    put_chunks(client, engine, keys, kv)
    wait_in_tier(client, keys, expect_tier, timeout_s)


def put_chunks(client: KVStoreClient, engine: CachedEngine, keys: list[bytes], kv: KVCache) -> None:
    """Put chunk c of ``kv`` under ``keys[c]``, 4 chunks per call."""
    n = engine.namespace.chunk_tokens
    for i in range(0, len(keys), 4):
        chunk_ids = range(i, min(i + 4, len(keys)))
        client.put(engine.namespace, [(keys[c], n, kv.export(c * n, (c + 1) * n)) for c in chunk_ids])


def wait_in_tier(client: KVStoreClient, keys: list[bytes], expect_tier: str, timeout_s: float = 120.0) -> None:
    """Wait until Lookup finds every one of ``keys`` with ``expect_tier`` as its highest tier."""
    deadline = time.monotonic() + timeout_s
    while True:
        hits = client.lookup(keys)
        if hits.hits == len(keys) and set(hits.tiers) == {expect_tier}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"stored {len(keys)} chunks but Lookup sees {hits.hits} in tiers {set(hits.tiers)}")
        time.sleep(0.2)


# -- ceilings --------------------------------------------------------------------------------------------


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dest = np.empty_like(src)
    np.copyto(dest, src)  # fault the pages in
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dest, src)
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def o_direct_read_gbps(folder: Path, nbytes: int, piece: int) -> float:
    """Read ``nbytes`` from a file with O_DIRECT in ``piece``-byte reads (one block each)."""
    piece = (piece + 4095) // 4096 * 4096
    pieces = max(1, nbytes // piece)
    path = folder / "ceiling.bin"
    with open(path, "wb") as f:
        for _ in range(pieces):
            f.write(os.urandom(1 << 20) * (piece >> 20) + os.urandom(piece % (1 << 20)))
        f.flush()
        os.fsync(f.fileno())
    buffer = mmap.mmap(-1, piece)
    best = 0.0
    for _ in range(2):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            start = time.perf_counter()
            for i in range(pieces):
                os.preadv(fd, [buffer], i * piece)
            best = max(best, pieces * piece / (time.perf_counter() - start) / 1e9)
        finally:
            os.close(fd)
    path.unlink()
    return best


# -- one timed run ----------------------------------------------------------------------------------------


@dataclass
class Run:
    ttft_s: float
    load_s: float = 0.0
    prefill_s: float = 0.0
    reused_tokens: int = 0


def run_engine(engine: CachedEngine, context_ids: list[int], question_ids: list[int], use_cache: bool,
               expect_tier: str | None) -> Run:
    result = engine.generate(context_ids + question_ids, max_new_tokens=1, use_cache=use_cache, store=False)
    if use_cache and (result.reused_tokens != len(context_ids) or set(result.tiers) != {expect_tier}):
        raise RuntimeError(f"expected all {len(context_ids)} context tokens from {expect_tier}, got "
                           f"{result.reused_tokens} from {sorted(set(result.tiers))} (errors={engine.errors})")
    return Run(result.ttft_s, result.load_s, result.prefill_s, result.reused_tokens)
