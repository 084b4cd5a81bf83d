"""An engine's guarded view of the daemon: load stored blocks, store new ones from a thread.

Shared by the engine adapters: the reference engine and transformers load a prompt's stored run of
chunks (`load_run`, `store_async`); CacheBlend loads whichever chunks are stored (`fetch_blocks`,
`store_blocks_async`). A daemon that is down, slow or wrong costs misses, never a failed request:
each failure is counted in :attr:`errors` and logged once. (The vLLM connector has its own load and
store path, engine_adapter/vllm/connector.py.)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from engine_adapter.client import FetchedBlock, KVStoreClient
from kvstore.dtypes import TORCH_DTYPES
from kvstore.keys import KVLayout, Namespace

log = logging.getLogger(__name__)


def block_tensor(payload: memoryview, layout: KVLayout, tokens: int) -> torch.Tensor:
    """A zero-copy tensor [layers, 2, kv_heads, tokens, head_dim] over a raw block payload."""
    tensor = torch.frombuffer(payload, dtype=TORCH_DTYPES[layout.dtype])
    return tensor.view(layout.block_shape(tokens))


def fetched_tensor(block: FetchedBlock) -> torch.Tensor:
    """A fetched block as a tensor: zero-copy for ``raw``, decoded for any other codec.

    A zero-copy tensor views the client's arena: use it before the ``fetch`` block ends.
    """
    if block.codec == "raw":
        return block_tensor(block.payload, block.layout, block.tokens)
    from compression import get_codec

    return get_codec(block.codec).decode(bytes(block.payload), block.codec_params,
                                         block.layout.block_shape(block.tokens), TORCH_DTYPES[block.layout.dtype])


def fetch_slot_bytes(layout: KVLayout, tokens: int) -> int:
    """Arena bytes to reserve per block: the raw size plus room for a lossless stage's overhead."""
    raw = layout.block_bytes(tokens)
    return raw + raw // 64 + 4096


class PrefixCache:
    def __init__(self, client: KVStoreClient | None, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.errors = 0
        self._warned = False
        self._store_lock = threading.Lock()  # one background store at a time, in order

    def failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if not self._warned:
            log.warning("kvstore daemon %s failed (%s); serving without the cache", what, exc)
            self._warned = True

    def load_run(self, keys: list[bytes], sink: Callable[[int, torch.Tensor], None], tiers: list[str]) -> int:
        """Feed the longest stored run of ``keys`` to ``sink(chunk index, block tensor)`` in order;
        returns the number of chunks fed. The tensor may view the client's arena: ``sink`` copies
        what it keeps. A gap or a daemon failure ends the run; chunks fed before it stand."""
        if self.client is None or not keys:
            return 0
        try:
            hits = self.client.lookup(keys).hits
        except Exception as exc:  # noqa: BLE001 - any daemon failure is a miss
            self.failed("lookup", exc)
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

        self.fetch_blocks(keys[:hits], fetch_slot_bytes(layout, n), take)
        return loaded

    def fetch_blocks(self, keys: list[bytes], slot: int, take: Callable[[int, FetchedBlock | None], bool],
                     batch_done: Callable[[float], None] | None = None) -> None:
        """Fetch ``keys`` (``slot`` arena bytes each) in as few Gets as the arena allows and call
        ``take(index in keys, block or None for a miss)`` for each, in order; ``take`` returns
        False to stop. ``batch_done(seconds)`` follows each Get whose blocks were all taken, with
        the time since it started. Blocks may view the client's arena: ``take`` copies what it
        keeps. A daemon failure ends the fetch (counted); blocks taken before it stand."""
        if self.client is None or not keys:
            return
        step = self.client.max_fetch_blocks(slot)
        try:
            for first in range(0, len(keys), step):
                started = time.perf_counter()
                with self.client.fetch(keys[first : first + step], slot) as blocks:
                    for index, block in enumerate(blocks, first):
                        if not take(index, block):
                            return
                if batch_done is not None:
                    batch_done(time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - any daemon failure is a miss
            self.failed("get", exc)

    def store_async(self, keys: list[bytes], chunks: range, chunk: Callable[[int], torch.Tensor],
                    done: threading.Event) -> None:
        """Put ``chunk(c)`` under ``keys[c]`` for each c in ``chunks`` from a background thread
        (see `store_blocks_async`)."""
        n = self.namespace.chunk_tokens
        self.store_blocks_async(len(chunks), lambda i: (keys[chunks[i]], n, chunk(chunks[i])), done)

    def store_blocks_async(self, count: int, block: Callable[[int], tuple[bytes, int, torch.Tensor]],
                           done: threading.Event) -> None:
        """Put ``block(0) .. block(count - 1)`` (each ``(key, tokens, payload)``, made in the thread)
        from a background thread, four per Put, after any store still running; ``done`` is set
        when finished (or at once when there is nothing to do)."""
        if self.client is None or count == 0:
            done.set()
            return

        def run() -> None:
            try:
                with self._store_lock:
                    for i in range(0, count, 4):
                        self.client.put(self.namespace, [block(j) for j in range(i, min(i + 4, count))])
            except Exception as exc:  # noqa: BLE001
                self.failed("put", exc)
            finally:
                done.set()

        threading.Thread(target=run, name="kvstore-store", daemon=True).start()
