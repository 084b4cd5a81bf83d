"""Routers route by kvstore: the daemon's KV events read by NVIDIA Dynamo's own KV indexer (the
``ai-dynamo-runtime`` wheel, run from its venv, `.venv-dynamo`, which `.ci/run` builds), and keyed
the way llm-d's indexer keys them.

Dynamo's standalone indexer (``python -m dynamo.indexer``) subscribes to each worker's ZMQ stream,
hashes the tokens of each event's blocks itself, chains them by the events' parent ids and, asked
``POST /query`` with a prompt's tokens, answers how many leading tokens each worker holds. These
tests put blocks (with their tokens and parents, as kvstore's clients do) into real daemons and
ask the indexer which daemon holds a prompt: every test here fails if Dynamo cannot decode or
chooses to drop what the daemon publishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.block import BlockHeader, pack_token_ids
from kvstore.daemon.event_format import decode_batch
from kvstore.daemon.event_replay import replay
from kvstore.daemon.events import EventPublisher
from kvstore.keys import Namespace, prefix_keys
from tests.conftest import free_port
from tests.test_daemon import BLOCK, LAYOUT

#: Dynamo's venv: KVSTORE_DYNAMO_PYTHON, else `.venv-dynamo` at the repository's root (`.ci/run`).
DYNAMO_PYTHON = Path(os.environ.get("KVSTORE_DYNAMO_PYTHON")
                     or Path(__file__).resolve().parent.parent / ".venv-dynamo" / "bin" / "python")

needs_dynamo = pytest.mark.skipif(
    not DYNAMO_PYTHON.exists()
    or subprocess.run([str(DYNAMO_PYTHON), "-c", "import dynamo.indexer"], capture_output=True).returncode != 0,
    reason="Dynamo's indexer is not installed (.ci/run builds .venv-dynamo with ai-dynamo-runtime)")

#: 256-token chunks, as kvstore's engines cut prompts (a smaller model layout keeps Puts fast).
NS = Namespace("router-model", LAYOUT, chunk_tokens=256)
CHUNK = NS.chunk_tokens


def document(chunks: int, seed: int, first: list[int] | None = None) -> list[int]:
    """A prompt's tokens: ``chunks`` chunks of random token ids (after ``first`` tokens, if given)."""
    rng = np.random.default_rng(seed)
    ids = list(first or []) + rng.integers(0, 49152, size=chunks * CHUNK).tolist()
    return ids[: chunks * CHUNK]


def put_document(client: KVStoreClient, tokens: list[int], seed: int = 0, durable: bool = False) -> list[bytes]:
    """Put a document's chunks as kvstore's engines do: each with its parent and its tokens
    (``durable``: return once the disk tier holds them too)."""
    keys = prefix_keys(NS, tokens)
    rng = np.random.default_rng(seed)
    layout_bytes = LAYOUT.block_bytes(CHUNK)
    blocks = [(key, CHUNK, rng.standard_normal(layout_bytes // 2).astype(np.float16), keys[i - 1] if i else b"",
               tokens[i * CHUNK : (i + 1) * CHUNK]) for i, key in enumerate(keys)]
    assert client.put(NS, blocks, durable=durable) == len(keys)
    return keys


def event_endpoints() -> dict[str, str]:
    return {"events_listen": f"tcp://127.0.0.1:{free_port()}", "events_replay": f"tcp://127.0.0.1:{free_port()}"}


class DynamoIndexer:
    """Dynamo's standalone KV indexer in a process of its own, as an operator runs it."""

    def __init__(self, block_size: int, log: Path, workers: str = "") -> None:
        """``workers``: its ``--workers`` (``ID=ENDPOINT,...``), as an operator starts it."""
        self.port = free_port()
        self.block_size = block_size
        self._log = log.open("wb")
        self.log = log
        self.proc = subprocess.Popen([str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--port", str(self.port),
                                      "--block-size", str(block_size), "--threads", "1",
                                      *(["--workers", workers] if workers else [])],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self._call("GET", "/workers")
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Dynamo's indexer did not start:\n{self.log.read_text()[-3000:]}") from None
                time.sleep(0.2)

    def _call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            text = reply.read().decode()
        return json.loads(text) if text.startswith(("{", "[")) else text

    def register(self, worker: int, events: dict[str, str]) -> None:
        """Subscribe to a daemon's stream as worker ``worker``, with its replay socket."""
        body = {"instance_id": worker, "endpoint": events["events_listen"], "model_name": "default",
                "block_size": self.block_size}
        if events.get("events_replay"):
            body["replay_endpoint"] = events["events_replay"]
        self._call("POST", "/register", body)

    def matched(self, tokens: list[int]) -> dict[int, int]:
        """Leading tokens of ``tokens`` each worker holds, by Dynamo's own reckoning."""
        reply = self._call("POST", "/query", {"token_ids": tokens, "model_name": "default"})
        return {int(worker): found["longest_matched"] for worker, found in reply.get("instances", {}).items()}

    def wait_for(self, tokens: list[int], expected, timeout: float = 20.0) -> dict[int, int]:
        """Query until ``expected(matched)`` holds (the indexer reads the stream behind the daemon)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.matched(tokens)
            if expected(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def decode_errors(self) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if "Failed to decode" in line or "too short" in line]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture
def dynamo(short_tmp):
    started: list[DynamoIndexer] = []

    def make(block_size: int) -> DynamoIndexer:
        indexer = DynamoIndexer(block_size, short_tmp / f"dynamo-{len(started)}.log")
        started.append(indexer)
        return indexer

    yield make
    for indexer in started:
        indexer.close()


@needs_dynamo
@pytest.mark.parametrize("block_size", [256, 16])
def test_dynamo_scores_the_daemon_holding_a_document_in_any_tier_and_nothing_after_clear(
        daemon_factory, dynamo, block_size):
    events = event_endpoints()
    d = daemon_factory(events_block_size=block_size if block_size != CHUNK else 0, disk_fsync="true", **events)
    indexer = dynamo(block_size)
    indexer.register(1, events)
    doc = document(6, seed=1)
    question = document(1, seed=99)[:40]
    with KVStoreClient(d.address) as client:
        put_document(client, doc, durable=True)
        got = indexer.wait_for(doc + question, lambda m: m.get(1, 0) >= len(doc))
        assert got == {1: len(doc)}, got  # every token of every chunk: 1,536 of the 1,576 asked
        # A prompt that shares the first two chunks, then differs, matches those two.
        other = doc[: 2 * CHUNK] + document(2, seed=7)
        assert indexer.matched(other) == {1: 2 * CHUNK}
        # The CPU tier cleared: the disk tier (write-through) still holds the document.
        assert client.clear(["cpu"]) == 6
        got = indexer.wait_for(doc, lambda m: m.get(1, 0) == len(doc))
        assert got == {1: len(doc)}, got
        client.clear()
        got = indexer.wait_for(doc, lambda m: not m.get(1, 0))
        assert not got.get(1, 0), got
    assert not indexer.decode_errors(), indexer.decode_errors()


@needs_dynamo
def test_eviction_lowers_the_score(daemon_factory, dynamo):
    events = event_endpoints()
    # room for 6 blocks, no disk: the second document of 4 evicts 2 of the first's
    d = daemon_factory(disk_path="", cpu_capacity=str(6 * (BLOCK * CHUNK // 64) + 65536), **events)
    indexer = dynamo(CHUNK)
    indexer.register(1, events)
    first, second = document(4, seed=2), document(4, seed=3)
    with KVStoreClient(d.address) as client:
        put_document(client, first)
        assert indexer.wait_for(first, lambda m: m.get(1) == len(first)) == {1: len(first)}
        put_document(client, second)
        got = indexer.wait_for(first, lambda m: m.get(1, 0) < len(first))
        held = client.lookup(prefix_keys(NS, first)).hits
        assert client.lookup(prefix_keys(NS, second)).hits == 4
    assert got.get(1, 0) == held * CHUNK < len(first), (got, held)
    assert indexer.matched(second) == {1: len(second)}


@needs_dynamo
def test_two_daemons_each_named_for_the_document_it_holds(daemon_factory, dynamo):
    indexer = dynamo(16)
    docs = {1: document(3, seed=11), 2: document(3, seed=12)}
    for worker, doc in docs.items():
        events = event_endpoints()
        d = daemon_factory(f"d{worker}", events_block_size=16, **events)
        indexer.register(worker, events)
        with KVStoreClient(d.address) as client:
            put_document(client, doc)
    for worker, doc in docs.items():
        got = indexer.wait_for(doc, lambda m: m.get(worker) == len(doc))
        assert got == {worker: len(doc)}, (worker, got)


@needs_dynamo
def test_a_router_joining_late_learns_what_the_daemon_holds(daemon_factory, dynamo):
    """A router started after the daemon published asks the replay socket for the batches it
    missed (seq 0 on), once, and scores the daemon for all it holds."""
    events = event_endpoints()
    d = daemon_factory(events_block_size=16, **events)
    doc, later = document(4, seed=21), document(2, seed=22)
    with KVStoreClient(d.address) as client:
        put_document(client, doc)
        time.sleep(0.5)
        indexer = dynamo(16)
        indexer.register(1, events)
        put_document(client, later)  # the first batch it sees is not seq 0: it replays the rest
        got = indexer.wait_for(doc, lambda m: m.get(1) == len(doc))
        assert got == {1: len(doc)}, got
        assert indexer.matched(later) == {1: len(later)}
        replays = client.stats().get("events_replays", {})
    assert sum(replays.values()) <= 3, replays  # no storm: each replay was decoded and used


@pytest.mark.parametrize("events_block_size", [16, 0], ids=["sub-blocks", "whole"])
def test_llm_d_keys_the_published_blocks_as_it_keys_the_prompt(daemon_factory, events_block_size):
    """llm-d's indexer (``llm-d-kv-cache``: ``pkg/kvevents/pool.go``, ``pkg/kvcache/kvblock/
    token_processor.go``) keys each BlockStored itself: the parent's engine id resolves to the
    request key it mapped before (an unknown parent drops the event), and the event's tokens, cut
    into 16-token blocks, chain on from it (FNV-64a over the canonical CBOR of ``[parent, tokens,
    None]``, the first parent derived from the hash seed and the model's name). Its Go code does
    not run here: `LlmdPool` follows those files, and every block the daemon publishes must be
    indexed under the keys llm-d computes for the prompt itself, on the topic it reads pods from."""
    events = event_endpoints()
    d = daemon_factory(events_block_size=events_block_size, events_topic="kv@pod-a@router-model", **events)
    doc = document(3, seed=31)
    with KVStoreClient(d.address) as client:
        put_document(client, doc)
        deadline = time.monotonic() + 10
        while True:
            batches = replay(events["events_replay"], 0)
            stored = sum(len(e.token_ids) for _, b in batches for e in b.events if type(e).__name__ == "BlockStored")
            if stored >= len(doc) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    pool = LlmdPool(model="router-model")
    for _, batch in batches:
        pool.apply(batch.events)
    wanted = pool.prompt_keys(doc)
    assert len(wanted) == len(doc) // 16 and all(key in pool.index for key in wanted)
    # the topic, as a subscriber receives it (llm-d parses kv@<pod>@<model>)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(events["events_listen"])
    sock.setsockopt(zmq.SUBSCRIBE, b"kv@pod-a@")
    time.sleep(0.3)
    with KVStoreClient(d.address) as client:
        put_document(client, document(1, seed=41))
    assert sock.poll(5000)
    topic, _, payload = sock.recv_multipart()
    sock.close()
    assert topic == b"kv@pod-a@router-model" and decode_batch(payload).events


class LlmdPool:
    """llm-d's event pool and token processor, as far as a BlockStored from kvstore reaches them
    (default config: 16-token blocks, hash seed "")."""

    def __init__(self, model: str, block_size: int = 16, seed: str = "") -> None:
        self.model, self.block_size = model, block_size
        self.init = self._hash(fnv64a(seed.encode()), None, model)
        self.request_keys: dict[int, list[int]] = {}  # engine key -> its request keys
        self.index: set[int] = set()

    @staticmethod
    def _hash(parent: int, tokens, extra) -> int:
        return fnv64a(cbor([parent, tokens, extra]))

    def _keys(self, parent: int, tokens: list[int]) -> list[int]:
        keys = []
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = self._hash(parent, tokens[start : start + self.block_size], None)
            keys.append(parent)
        return keys

    def prompt_keys(self, tokens: list[int]) -> list[int]:
        return self._keys(self.init, tokens)

    def apply(self, events) -> None:
        for event in events:
            if type(event).__name__ != "BlockStored":
                continue
            parent = self.init
            if event.parent_block_hash:
                if event.parent_block_hash not in self.request_keys:
                    continue  # "Failed to get request key for parent block": dropped
                parent = self.request_keys[event.parent_block_hash][-1]
            keys = self._keys(parent, list(event.token_ids))
            if not keys:
                continue
            # engine keys map to request keys 1:1, many:1 or 1:many, by their counts
            engine = list(event.block_hashes)
            per = max(1, len(keys) // len(engine))
            for i, key in enumerate(engine):
                self.request_keys[key] = keys[i * per : (i + 1) * per] or keys[-1:]
            self.index.update(keys)


def fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def cbor(value) -> bytes:
    """Canonical CBOR (RFC 8949, shortest form) of unsigned ints, text, None and lists of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, list):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    return _cbor_head(0, value)


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(n)


@needs_dynamo
def test_a_router_joining_after_the_kept_batches_learns_from_the_snapshot(dynamo):
    """The batches that announced a document have left the replay buffer (3 kept here): a router
    joining now asks from seq 0 and gets a snapshot of what is held, then the kept batches."""
    events = event_endpoints()
    publisher = EventPublisher(events["events_listen"], [("cpu", False)], replay_endpoint=events["events_replay"],
                               replay_batches=3, block_size=16)
    publisher.start()
    try:
        doc = document(6, seed=51)
        keys = prefix_keys(NS, doc)
        for i, key in enumerate(keys):  # a batch each: seqs 1..6, of which 4..6 are kept
            publisher.stored(key, 0, chunk_header(key, doc, i, keys))
            wait_published(publisher, 2 + i)
        publisher.removed(keys[-1], 0)  # the last chunk leaves: the snapshot must not have it
        wait_published(publisher, 8)
        indexer = dynamo(16)
        indexer.register(1, events)
        time.sleep(1.0)
        later = document(1, seed=52)
        (key,) = prefix_keys(NS, later)
        publisher.stored(key, 0, chunk_header(key, later, 0, [key]))  # seq 8: it asks for 0..7
        got = indexer.wait_for(doc, lambda m: m.get(1) == 5 * CHUNK)
        assert got == {1: 5 * CHUNK}, got
        assert indexer.wait_for(later, lambda m: m.get(1) == CHUNK) == {1: CHUNK}
    finally:
        publisher.close()


def chunk_header(key: bytes, tokens: list[int], i: int, keys: list[bytes]) -> BlockHeader:
    """The header a tier keeps for chunk ``i`` of ``tokens``, with its parent and token ids."""
    return BlockHeader(key=key, namespace=NS.id, layout=LAYOUT, tokens=CHUNK, payload_len=LAYOUT.block_bytes(CHUNK),
                       checksum=1, parent=keys[i - 1] if i else b"",
                       token_ids=pack_token_ids(tokens[i * CHUNK : (i + 1) * CHUNK]))


def wait_published(publisher: EventPublisher, events: int) -> None:
    deadline = time.monotonic() + 5
    while publisher.published < events:
        assert time.monotonic() < deadline, "the publisher stopped publishing"
        time.sleep(0.01)


@needs_dynamo
def test_a_restarted_daemon_announces_what_it_found_on_disk_with_tokens_and_parents(daemon_factory, dynamo):
    """The header keeps each block's parent and tokens, so the blocks a restarted daemon finds on
    disk are announced as routers need them, and a hit promoted back to the CPU tier too."""
    events = event_endpoints()
    d = daemon_factory(events_block_size=16, disk_fsync="true", **events)
    doc = document(4, seed=61)
    with KVStoreClient(d.address) as client:
        keys = put_document(client, doc, durable=True)
    assert d.stop() == 0
    d.start()
    indexer = dynamo(16)
    indexer.register(1, events)
    with KVStoreClient(d.address) as client:
        got = indexer.wait_for(doc, lambda m: m.get(1) == len(doc))
        assert got == {1: len(doc)}, got
        client.get(keys, LAYOUT.block_bytes(CHUNK))  # disk hits, promoted to the CPU tier
        deadline = time.monotonic() + 10
        while client.lookup(keys).tiers != ("cpu",) * len(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.lookup(keys).tiers == ("cpu",) * len(keys)
    stored = [e for _, b in replay(events["events_replay"], 0) for e in b.events
              if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    assert sorted(t for e in stored for t in e.token_ids) == sorted(doc)
    assert sum(e.parent_block_hash is None for e in stored) == 1
    assert not indexer.decode_errors()


@needs_dynamo
@pytest.mark.slow
def test_as_an_operator_runs_it_kvstore_ingest_then_clear(daemon_factory, short_tmp):
    """The commands of docs/operations.md: Dynamo's indexer started with ``--workers``, a daemon
    publishing 16-token blocks, ``kvstore ingest`` of a document (SmolLM2, its 256-token chunks),
    a query with the document's tokens, then ``kvstore clear``."""
    from importlib import resources

    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.reference.prompts import document_prompt
    from tests.test_operator import finish, kvstore

    sample = json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())
    text = sample["document"][:6000]
    path = short_tmp / "doc.txt"
    path.write_text(text)
    events = event_endpoints()
    d = daemon_factory(events_block_size=16, **events)
    query = DynamoIndexer(16, short_tmp / "dynamo-cli.log", workers=f"1={events['events_listen']}")
    try:
        time.sleep(1.0)  # its subscription reaches the daemon
        code, out, err = finish(kvstore("ingest", path, "--address", d.address), timeout=600)
        assert code == 0, err
        _, tokenizer = load_gguf(find_smollm2_gguf())
        context, _ = document_prompt(tokenizer, text, "")
        stored = len(context) // 256 * 256
        got = query.wait_for(context, lambda m: m.get(1, 0) >= stored)
        assert got.get(1, 0) >= 0.9 * len(context) and got == {1: stored}, (got, len(context))
        code, out, err = finish(kvstore("clear", "--address", d.address))
        assert code == 0, err
        got = query.wait_for(context, lambda m: not m.get(1, 0))
        assert not got.get(1, 0), got
    finally:
        query.close()
