"""The cache daemon: one process serving kvstore.v1 over gRPC next to an inference engine.

This floor stands on the ground floor, ``kvstore/`` (block format, keys and layouts, dtypes, wire
conversion, limits, the arena protocol, the shared key index, this host's defaults and secret, the
sizes and files users write) and on ``tiers/``; nothing below it imports it. Its modules, by role:

- serving: ``process.py`` (the process: its parts put together, health, metrics, orderly
  shutdown), ``tier_setup.py`` (tiers from config), ``grpc_listener.py`` (listening, TLS, the
  token interceptor), ``server.py`` (the gRPC handlers), ``transfers.py`` (Put and Get for a
  tenant, shared by gRPC and the data channel: validation, tenants' keys, byte bounds, the
  error-to-status map), ``data_channel.py`` (raw payloads beside gRPC for clients without shared
  memory), ``data_admission.py`` (its connection slots and tenants' shares), ``probes.py``,
  ``config.py``, ``auth.py`` (tenants), ``arena_registry.py`` (arenas handed to same-host clients);
- the store: ``placement.py`` (``BlockStore``), ``residency.py``, ``holds.py``, ``eviction.py``,
  ``reads.py``, ``promotion.py``, ``write_behind.py``, ``tier_io.py``, ``autocal.py`` with
  ``autocal_bounds.py`` (what it calibrates, each coded block's error check);
- what operators and routers read: ``metrics.py``, ``events.py`` (the publisher) with
  ``event_format.py`` (vLLM's wire format) and ``event_replay.py``;
- small parts: ``budget.py``, ``log_limit.py``.

The package imports nothing itself, so ``import kvstore.daemon.config`` costs only that module.
"""
