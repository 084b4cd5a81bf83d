"""Every engine's guarded view of the daemon: look up, load and store blocks, misses on failure.

The one load/store path of the engine adapters: the reference engine and transformers load a
prompt's stored run of chunks into a KV cache (`load`, which copies once where the cache is in
shared memory and twice otherwise; `store_async`); CacheBlend loads whichever chunks are
stored (`fetch_blocks`, `store_blocks_async`); the vLLM connector looks up (`lookup`), loads
(`fetch_blocks`) and stores from its step (`put`) or behind it (`store_blocks_async`).

A daemon that is down, slow or wrong costs misses, never a failed request: every call is guarded
and each failure counted in :attr:`errors`; an outage is logged once when it starts and once when
a call succeeds again. Built with ``connect`` (a client factory), the cache connects lazily and
after a failure drops the client and serves without the daemon for ``retry_s`` before connecting
again; built with a client, it keeps calling that client.

Stores run in order on one background thread. ``max_queued`` bounds the blocks waiting for it
(`store_room`); a caller with more than the room drops the rest (the vLLM connector counts them).
``max_lag_s`` bounds how far behind it may fall: while the oldest store waiting or running was
queued longer ago than that (the daemon or the copies are slower than the requests), there is no
room at all, so a store behind is skipped rather than queued (and counted: ``skipped``, which the
client also reports to the daemon, ``kvstore_client_stores_skipped_total``); nothing on a request's
path waits for a store (`available` says whether to make one without connecting).

Loads decode a Get's coded blocks (any codec but ``raw``) on a pool of `DECODE_THREADS` threads,
a few blocks ahead of the caller, which takes them in order (`fetch_blocks`): the codecs' hot
loops (native C, torch) release the GIL, so a kvtc or int4 load uses the host's cores, not one.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import torch

from engine_adapter.client.blocks import BlockToPut, FetchedBlock, Rows, RowsGot
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.client.shared_kv import RowsInRegion, SharedRegion, chunk_rows
from kvstore.keys import KVLayout, LookupResult, Namespace
from compression.transcode import payload_tensor

log = logging.getLogger(__name__)

STORE_BATCH = 4  # blocks per background Put: one RPC per few blocks, a failure costs few
DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))  # decoders of a Get's coded blocks (one pool per process)

_decode_pool: ThreadPoolExecutor | None = None
_decode_pool_lock = threading.Lock()


def decode_pool() -> ThreadPoolExecutor:
    global _decode_pool
    with _decode_pool_lock:
        if _decode_pool is None:
            _decode_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="kvstore-decode")
        return _decode_pool


def _forget_decode_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there; make a new pool on first use."""
    global _decode_pool, _decode_pool_lock
    _decode_pool, _decode_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_decode_pool)


def fetched_tensor(block: FetchedBlock) -> torch.Tensor:
    """A fetched block as a tensor: zero-copy for ``raw``, decoded for any other codec.

    A zero-copy tensor views the client's arena: use it before the ``fetch`` block ends.
    """
    if block.decoded is not None:
        return block.decoded
    return payload_tensor(block.payload, block.codec, block.codec_params, block.layout, block.tokens)


def _decode_or_none(block: FetchedBlock) -> torch.Tensor | None:
    try:
        return fetched_tensor(block)
    except Exception:  # noqa: BLE001 - the caller decodes it again in place and meets the error there
        return None


def decoded_ahead(blocks: Sequence[FetchedBlock | None], window: int | None = None) -> Iterator[FetchedBlock | None]:
    """``blocks`` in order, the coded ones decoded on `decode_pool` up to ``window`` blocks ahead (default
    2 * `DECODE_THREADS`) when there are two or more. A block whose decode failed comes as it was, so
    that the caller (which may reject it first) meets the error where it would have without this.
    A decoded tensor is held only until its block is handed out. Closing the iterator cancels the
    decodes not started and waits for the running ones, which read the payloads: close it before the
    payloads' Get ends."""
    coded = [b is not None and b.codec != "raw" and b.decoded is None for b in blocks]
    if sum(coded) < 2 or DECODE_THREADS < 2:
        yield from blocks
        return
    window = window or 2 * DECODE_THREADS
    futures: dict[int, Future] = {}
    submitted = 0
    try:
        pool = decode_pool()
        for index, block in enumerate(blocks):
            while submitted < len(blocks) and submitted <= index + window:
                if coded[submitted]:
                    futures[submitted] = pool.submit(_decode_or_none, blocks[submitted])
                submitted += 1
            future = futures.pop(index, None)
            decoded = future.result() if future is not None else None
            yield block if decoded is None else dataclasses.replace(block, decoded=decoded)
    finally:
        for future in futures.values():
            if not future.cancel():
                future.result()  # (never raises: _decode_or_none)


def fetch_slot_bytes(layout: KVLayout, tokens: int) -> int:
    """Arena bytes to reserve per block: the raw size plus room for a lossless stage's overhead."""
    raw = layout.block_bytes(tokens)
    return raw + raw // 64 + 4096


#: The connector's bound on how long a store may wait or run before new ones are skipped (`PrefixCache`).
STORE_LAG_S = 1.0


class _StoreJob:
    def __init__(self, count: int, block: Callable[[int], BlockToPut | tuple],
                 done: threading.Event | None, stored: Callable[[int], None] | None, durable: bool) -> None:
        self.count, self.block, self.done, self.stored, self.durable = count, block, done, stored, durable
        self.queued_at = time.monotonic()


class PrefixCache:
    def __init__(self, client: KVStoreClient | None, namespace: Namespace, *,
                 connect: Callable[[], KVStoreClient] | None = None, retry_s: float = 0.0,
                 address: str = "", max_queued: int = 0, max_lag_s: float = 0.0,
                 logger: logging.Logger | None = None) -> None:
        self.namespace = namespace
        self.address = address or (client.address if client is not None else "")
        self.retry_s = retry_s
        self.max_queued = max_queued  # blocks waiting for the store thread; 0: no bound
        self.max_lag_s = max_lag_s    # the oldest store's age past which new ones are skipped; 0: no bound
        self.skipped = 0              # blocks a caller skipped for want of room (`skip`)
        self.errors = 0
        self.outages = 0
        self._client = client
        self._connect = connect
        self._log = logger or log
        self._down_until = 0.0
        self._down_since: float | None = None  # set while in an outage
        self._lock = threading.Lock()
        self._register_calibration_source()
        self._jobs: queue.Queue[_StoreJob | None] = queue.Queue()
        self._queued = 0  # blocks in self._jobs or being stored
        self._pending: collections.deque[_StoreJob] = collections.deque()  # jobs queued or running, oldest first
        self._store_thread: threading.Thread | None = None

    # -- the daemon, guarded ------------------------------------------------------------------

    def _register_calibration_source(self) -> None:
        """Let a kvtc block's calibration be fetched from this cache's daemon when this host lacks its
        file (one the daemon made with kvtc@auto, or `kvstore calibrate` ran on another host)."""
        from compression import calibration_store

        ref = weakref.ref(self)

        def fetch(calibration_id: str) -> bytes | None:
            cache = ref()
            client = cache.client() if cache is not None else None
            if client is None:
                return None
            try:
                return calibration_store.fetch_calibration(client, calibration_id)
            except Exception:  # noqa: BLE001 - no calibration from here: the block is a miss
                return None

        self._calibration_source = fetch
        calibration_store.add_source(fetch)

    def client(self) -> KVStoreClient | None:
        """The client to call now; None while there is none or the daemon is taken to be down."""
        if self._client is not None or self._connect is None:
            return self._client
        with self._lock:
            if self._client is None and time.monotonic() >= self._down_until:
                try:
                    self._client = self._connect()
                except Exception as exc:  # noqa: BLE001 - a daemon that is down is a miss
                    self._failed_locked("connect", exc)
            return self._client

    def ok(self) -> None:
        """A call succeeded: ends an outage, and says so."""
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                self._log.warning("kvstore daemon at %s is back after %.1f s; the cache is used again",
                                  self.address, time.monotonic() - self._down_since)
                self._down_since = None

    def failed(self, what: str, exc: BaseException) -> None:
        """A call failed: counted; an outage starts (said once); a connecting cache steps aside."""
        with self._lock:
            self._failed_locked(what, exc)

    def _failed_locked(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self._connect is not None:
            self._down_until = time.monotonic() + self.retry_s
            if self._client is not None:
                try:
                    self._client.close()
                except Exception:  # noqa: BLE001
                    pass
                self._client = None
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.outages += 1
            retry = f", retrying every {self.retry_s:g} s" if self._connect is not None else ""
            self._log.warning("kvstore daemon at %s: %s failed (%s); serving without the cache%s",
                              self.address, what, exc, retry)
        else:
            self._log.debug("kvstore daemon at %s: %s failed again (%s)", self.address, what, exc)

    def lookup(self, keys: Sequence[bytes], lease_s: float = 0.0) -> LookupResult | None:
        """The daemon's hits for ``keys`` (a lease keeps them from eviction ``lease_s``); None
        when the daemon is down or failed (a miss)."""
        client = self.client() if keys else None
        if client is None:
            return None
        try:
            found = client.lookup(keys, lease_s=lease_s)
        except Exception as exc:  # noqa: BLE001 - any daemon failure is a miss
            self.failed("lookup", exc)
            return None
        self.ok()
        return found

    def load_run(self, keys: list[bytes], sink: Callable[[int, torch.Tensor], None], tiers: list[str]) -> int:
        """Feed the longest stored run of ``keys`` to ``sink(chunk index, block tensor)`` in order;
        returns the number of chunks fed. The tensor may view the client's arena: ``sink`` copies
        what it keeps. A gap or a daemon failure ends the run; chunks fed before it stand."""
        found = self.lookup(keys)
        if found is None or not found.hits:
            return 0
        n, layout = self.namespace.chunk_tokens, self.namespace.layout
        loaded = 0

        def take(index: int, block: FetchedBlock | None) -> bool:
            nonlocal loaded
            if block is None or block.tokens != n or block.layout != layout:
                return False  # a gap ends the run
            sink(loaded, fetched_tensor(block))
            tiers.append(block.tier)
            loaded += 1
            return True

        self.fetch_blocks(keys[: found.hits], fetch_slot_bytes(layout, n), take)
        return loaded

    def load(self, keys: list[bytes], kv: Any, tiers: list[str]) -> int:
        """Load the longest stored run of ``keys`` (one chunk each) into the KV cache ``kv`` from
        token 0 (a `KVCache`: ``capacity``, ``load(block, start)`` and, for one copy, what
        `shared_kv.chunk_rows` reads); returns the chunks loaded, sets ``kv.length`` to their tokens
        and appends each one's tier to ``tiers``. Where ``kv`` is in a shared region the daemon
        holds (`shared_kv.SharedKVMemory`), the daemon copies each raw block's rows straight into
        the cache, one copy in all; a coded block (nothing copied for it) and the run after it, and
        any other cache, load the two-copy way (`load_run`: into the arena, then into the cache)."""
        n = self.namespace.chunk_tokens
        kv.length = 0
        in_rows = chunk_rows(kv, n, len(keys))
        if in_rows is None:
            return self.load_run(keys, lambda c, block: kv.load(block, c * n), tiers)
        got = self.get_rows(keys[:len(in_rows.places)], in_rows.region, in_rows.places, leading_run=True)
        loaded = 0
        for block in got:
            if not block.in_place:
                break  # a gap ends the run; a coded block (not copied) loads below
            tiers.append(block.tier)
            loaded += 1
        kv.length = loaded * n
        if loaded < len(got) and got[loaded].found and got[loaded].codec != "raw":
            # A coded block: it and the run after it the two-copy way (decoded into the cache).
            loaded += self.load_run(keys[loaded:], lambda c, b: kv.load(b, (loaded + c) * n), tiers)
        return loaded

    def get_rows(self, keys: list[bytes], region: SharedRegion, places: Sequence[Rows],
                 leading_run: bool = False) -> list[RowsGot]:
        """`KVStoreClient.get_rows` into ``region``, guarded: every key a miss when the daemon is
        down or failed (counted). ``leading_run``: the held run of ``keys`` alone, looked up first."""
        client = self.client() if keys else None
        if client is None:
            return [] if leading_run else [RowsGot(False, False)] * len(keys)
        try:
            got = client.get_rows(region.arena_id, keys, places, self.namespace.layout, leading_run)
        except Exception as exc:  # noqa: BLE001 - any daemon failure is a miss
            self.failed("load" if leading_run else "get", exc)
            return [] if leading_run else [RowsGot(False, False)] * len(keys)
        self.ok()
        return got

    def fetch_blocks(self, keys: list[bytes], slot: int, take: Callable[[int, FetchedBlock | None], bool],
                     batch_done: Callable[[float], None] | None = None) -> None:
        """Fetch ``keys`` (``slot`` arena bytes each) and call ``take(index in keys, block or None
        for a miss)`` for each, in order; ``take`` returns False to stop. The Gets go two at a time
        (`KVStoreClient.fetch_ahead`). ``batch_done(seconds)`` follows each Get whose blocks were
        all taken, with the time it added to the fetch. Blocks may view the client's arena: ``take`` copies what it
        keeps. A daemon failure ends the fetch (counted); blocks taken before it stand."""
        client = self.client() if keys else None
        if client is None:
            return
        # Four Gets or more, two in flight: the daemon fills one batch while this thread takes the last.
        fetches = client.fetch_ahead(keys, slot, batch=-(-len(keys) // 4))
        try:
            started = time.perf_counter()
            for first, blocks in fetches:
                ahead = decoded_ahead(blocks)
                try:
                    for index, block in enumerate(ahead, first):
                        if not take(index, block):
                            self.ok()
                            return
                finally:
                    ahead.close()  # before the Get's arena is released: decodes read it
                if batch_done is not None:  # the time this batch added: Gets overlap
                    now = time.perf_counter()
                    batch_done(now - started)
                    started = now
        except Exception as exc:  # noqa: BLE001 - any daemon failure is a miss
            self.failed("get", exc)
            return
        finally:
            fetches.close()  # the batches still in flight end before their arena space is reused
        self.ok()

    def put(self, blocks: Sequence[BlockToPut | tuple], durable: bool = False) -> bool:
        """Put ``blocks`` (`BlockToPut`s or their tuples: `KVStoreClient.put`; a payload may be a
        `RowsInRegion`) now, in their order; False when the daemon is down or failed.
        ``durable``: return once a durable tier (fsynced disk, S3) holds them."""
        client = self.client() if blocks else None
        if client is None:
            return not blocks
        try:
            # blocks in a KV cache's region go in rows (one copy, the daemon's), unless the daemon no
            # longer holds the region (restarted): those are copied here and go as any other
            blocks = [BlockToPut.of(b) for b in blocks]
            blocks = [dataclasses.replace(b, payload=b.payload.copy()) if _in_rows(b) and not b.payload.region.alive
                      else b for b in blocks]
            for in_rows, run in itertools.groupby(blocks, _in_rows):
                if in_rows:
                    client.put_rows(self.namespace, list(run), durable)  # a failed call retires its regions
                else:
                    client.put(self.namespace, list(run), durable=durable)
        except Exception as exc:  # noqa: BLE001
            self.failed("put", exc)
            return False
        self.ok()
        return True

    # -- stores behind the request ------------------------------------------------------------

    def store_async(self, keys: list[bytes], chunks: range, chunk: Callable[[int], torch.Tensor | RowsInRegion],
                    done: threading.Event, token_ids: Sequence[int] | None = None) -> None:
        """Put ``chunk(c)`` under ``keys[c]`` for each c in ``chunks`` from the store thread
        (see `store_blocks_async`); ``token_ids``, the prompt's, names each chunk's tokens."""
        n = self.namespace.chunk_tokens

        def block(i: int) -> BlockToPut:
            c = chunks[i]
            ids = token_ids[c * n : (c + 1) * n] if token_ids is not None else ()
            return BlockToPut(keys[c], n, chunk(c), keys[c - 1] if c else b"", ids)

        self.store_blocks_async(len(chunks), block, done)

    def available(self) -> bool:
        """Whether a store made now may reach the daemon: connected, or free to connect (not within
        ``retry_s`` of a failure). Never connects: the store thread does, off the request's path."""
        return self._client is not None or (self._connect is not None and time.monotonic() >= self._down_until)

    def store_room(self) -> int:
        """How many more blocks the store thread takes now: ``max_queued`` less those queued, and
        none while the oldest store queued is ``max_lag_s`` old (the thread is behind)."""
        with self._lock:
            if self.max_lag_s > 0 and self._pending and \
                    time.monotonic() - self._pending[0].queued_at > self.max_lag_s:
                return 0
            return 1 << 62 if self.max_queued <= 0 else max(0, self.max_queued - self._queued)

    def skip(self, blocks: int) -> None:
        """A caller skipped ``blocks`` stores for want of room: counted here, and reported to the
        daemon on the client's next call (when there is a client)."""
        if blocks <= 0:
            return
        with self._lock:
            self.skipped += blocks
            client = self._client
        if client is not None:
            client.count_skipped_stores(blocks)

    def store_blocks_async(self, count: int, block: Callable[[int], BlockToPut | tuple],
                           done: threading.Event | None = None, stored: Callable[[int], None] | None = None,
                           durable: bool = False) -> int:
        """Put ``block(0) .. block(count - 1)`` (each a `BlockToPut` or its tuple, made on the store
        thread) in Puts of `STORE_BATCH`, after every store queued before; returns how many were
        queued: all of them, or the first `store_room` ones. When they are done, ``stored(n)`` says
        how many the daemon took (the first n: a failure ends the job) and ``done`` is set (at once
        when nothing was queued)."""
        with self._lock:
            if self._client is None and self._connect is None:
                count = 0
            elif self.max_queued > 0:
                count = max(0, min(count, self.max_queued - self._queued))
            self._queued += count
            job = _StoreJob(count, block, done, stored, durable)
            if count:
                self._pending.append(job)
            if count and self._store_thread is None:
                self._store_thread = threading.Thread(target=self._store_loop, name="kvstore-store", daemon=True)
                self._store_thread.start()
        if count == 0:
            if stored is not None:
                stored(0)
            if done is not None:
                done.set()
            return 0
        self._jobs.put(job)
        return count

    def _store_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            put = 0
            try:
                for first in range(0, job.count, STORE_BATCH):
                    blocks = [job.block(i) for i in range(first, min(first + STORE_BATCH, job.count))]
                    if not self.put(blocks, durable=job.durable):
                        break
                    put += len(blocks)
            except Exception as exc:  # noqa: BLE001 - a block that cannot be made is not stored
                self.failed("put", exc)
            finally:
                with self._lock:
                    self._queued -= job.count
                    self._pending.popleft()  # this job: the thread takes them in the order queued
                if job.stored is not None:
                    job.stored(put)
                if job.done is not None:
                    job.done.set()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued stores (waiting at most ``timeout``), then close a client it connected."""
        from compression import calibration_store

        calibration_store.remove_source(self._calibration_source)
        thread = self._store_thread
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
        if self._connect is not None:
            with self._lock:
                if self._client is not None:
                    self._client.close()
                    self._client = None


def _in_rows(block: BlockToPut) -> bool:
    """Whether ``block``'s payload lies in a KV cache's shared region (a Put in rows)."""
    return isinstance(block.payload, RowsInRegion)
