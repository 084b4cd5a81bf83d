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
#: Copies of its payloads a gRPC inline Get's reply makes in the daemon, each charged to the
#: daemon's inline budget (``max_inline_bytes``) until gRPC sent it: the buffers the tiers read into,
#: the serialized reply, and gRPC's own copy of it, made on gRPC's thread (whose malloc arena does
#: not reuse what the first two freed: kvstore/daemon/process.py keep_freed_memory). Measured: one
#: 48 MiB Get raised the daemon's peak RSS by 132 MiB (2.75x), one 250 MiB Get by 747 MiB. A Get
#: whose copies exceed the whole budget is refused; the client plans its inline Gets to fit.
#: The data channel sends from its read buffers (one copy).
GRPC_GET_COPIES = 3
