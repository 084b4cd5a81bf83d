"""Per-call limits of the kvstore.v1 API, shared by the daemon (which enforces them before any
work) and the client (which splits its calls to stay within them)."""

#: Keys in one Lookup, Prefetch, Delete, Pin, Unpin or Release (cheap per key: index probes).
MAX_KEYS_PER_CALL = 65536
#: Blocks in one Put, Get or GetLayers (each one is copied, checksummed and described in the reply).
MAX_ITEMS_PER_CALL = 4096
#: Layers one block may have (a GetLayers stream sends one message per layer).
MAX_LAYERS = 1024
#: Layer copies one GetLayers may ask for: the sum of its blocks' layers.
MAX_LAYER_COPIES = 65536
#: Longest lease a Lookup may take on its hits (``LookupRequest.lease_ms``): long enough for an
#: engine to schedule and load, short enough that a client that never loads frees the space soon.
MAX_LEASE_MS = 30_000
#: gRPC metadata by which a client reports stores it skipped because its store queue was behind
#: (``N``, ASCII decimal; engine_adapter/client/prefix_cache.py), counted by the daemon as
#: ``kvstore_client_stores_skipped_total``; at most ``MAX_SKIPPED_REPORT`` a call.
SKIPPED_STORES_HEADER = "kvstore-skipped-stores"
MAX_SKIPPED_REPORT = 1 << 20
