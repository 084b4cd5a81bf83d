"""Prometheus metrics of one daemon, in a registry of its own (several daemons per test process).

What /metrics shows is the daemon's totals, labelled by tier, RPC method or outcome only: never a
tenant's name, a key, a namespace, or one tenant's share of the traffic (Stats gives a named tenant
its own counts; these sum everyone's). The daemon serves it on loopback unless ``metrics_public``
(kvstore/daemon/config.py), so reaching it takes a local account; see docs/operations.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # What each counts, and which client paths feed it: docs/operations.md, "Metrics".
        self.hits = Counter("kvstore_hits", "Blocks served by Get and GetLayers, by tier (get hit ratio: "
                            "sum(hits) / requested{rpc=\"get\"})", ["tier"], registry=r)
        self.misses = Counter("kvstore_misses", "Keys asked for by Lookup (past the hit run; clients' local "
                              "Lookups included) or Get and not found", registry=r)
        self.requested = Counter("kvstore_requested", "Keys asked for, by RPC (lookup: clients' local Lookups "
                                 "included; misses / requested: the miss ratio)", ["rpc"], registry=r)
        self.lookup_hits = Counter("kvstore_lookup_hits", "Keys in Lookups' hit runs, clients' local Lookups "
                                   "included (lookup hit ratio: lookup_hits / requested{rpc=\"lookup\"})",
                                   registry=r)
        self.lookups = Counter("kvstore_lookups", "Lookups of at least one key, by path: rpc (the daemon "
                               "answered) or local (a same-host client's key index, as the client reported)",
                               ["path"], registry=r)
        self.reported_keys = Counter("kvstore_local_lookup_keys", "Hit keys of clients' local Lookups, as reported, "
                                     "by what came of them: held (a use under eviction adaptive), not_held (no tier "
                                     "holds it now), dropped (past the reports' rate bound)", ["outcome"], registry=r)
        self.stores_skipped = Counter("kvstore_client_stores_skipped", "Blocks clients did not store because their "
                                      "store queue was behind (the daemon or the copies slower than the requests), "
                                      "as they reported", registry=r)
        self.arc_frequent = Gauge("kvstore_arc_frequent_blocks", "A tier's blocks used again since they entered it "
                                  "(ARC's frequent segment; eviction adaptive only)", ["tier"], registry=r)
        for path in ("rpc", "local"):  # shown from the start, at 0: a ratio has its denominator at once
            self.lookups.labels(path)
        for rpc in ("lookup", "get"):
            self.requested.labels(rpc)
        self.bytes_in = Counter("kvstore_bytes_in", "Block bytes written into a tier", ["tier"], registry=r)
        self.bytes_out = Counter("kvstore_bytes_out", "Block bytes read out of a tier", ["tier"], registry=r)
        self.evictions = Counter("kvstore_evictions", "Blocks evicted from a tier", ["tier"], registry=r)
        self.promotions = Counter("kvstore_promotions", "Blocks copied up into a tier", ["tier"], registry=r)
        self.demotions = Counter("kvstore_demotions", "Blocks moved down into a tier", ["tier"], registry=r)
        self.not_admitted = Counter("kvstore_not_admitted", "Blocks a tier did not take (admission "
                                    "\"reused\": never read since stored), at a Put or an eviction above it",
                                    ["tier"], registry=r)
        self.corrupt = Counter("kvstore_corrupt_blocks", "Blocks that failed validation (deleted)", ["tier"], registry=r)
        self.write_errors = Counter("kvstore_write_errors", "Failed writes to a tier", ["tier"], registry=r)
        self.tier_degraded = Gauge("kvstore_tier_degraded", "1 while a tier keeps failing: write errors over a "
                                   "window, or unreachable (S3's circuit open); /readyz names it "
                                   "(kvstore/daemon/tier_health.py)", ["tier"], registry=r)
        self.queue_dropped = Counter("kvstore_queue_dropped",
                                     "Write-through copies skipped because the queue was full", registry=r)
        self.queue_depth = Gauge("kvstore_queue_depth", "Pending lower-tier writes", registry=r)
        self.tier_queue_depth = Gauge("kvstore_tier_queue_depth", "Pending writes into a lower tier, by target tier",
                                      ["tier"], registry=r)
        self.tier_queue_dropped = Counter("kvstore_tier_queue_dropped",
                                          "Copies into a lower tier skipped because its queue was full", ["tier"],
                                          registry=r)
        self.unavailable = Counter("kvstore_tier_unavailable",
                                   "Reads and writes that found a tier unreachable (served as misses)", ["tier"],
                                   registry=r)
        self.auto_calibration = Counter(
            "kvstore_auto_calibration", "kvtc@auto: blocks sampled, coded, or stored as they are (over_error, busy, "
            "not_finite, unreadable), and calibrations made", ["outcome"], registry=r)
        self.holds_refused = Counter("kvstore_holds_refused",
                                     "Pins and leases refused: the tenant would pass its bound of held bytes",
                                     ["kind"], registry=r)
        self.discovered = Counter("kvstore_discovered", "Blocks found in a shared tier that another host stored",
                                  ["tier"], registry=r)
        self.events_published = Counter("kvstore_events_published", "KV events published for routers", registry=r)
        self.events_dropped = Counter("kvstore_events_dropped",
                                      "KV events dropped because the publisher's queue was full (subscribers see a "
                                      "seq gap)", registry=r)
        self.events_replays = Counter("kvstore_events_replays",
                                      "KV-event replay requests served, refused (over the rate or the replies at once) "
                                      "or malformed, and replies abandoned (the peer read nothing or left)",
                                      ["outcome"], registry=r)
        self.used_bytes = Gauge("kvstore_used_bytes", "Bytes stored, by tier", ["tier"], registry=r)
        self.blocks = Gauge("kvstore_blocks", "Blocks stored, by tier", ["tier"], registry=r)
        self.namespaces = Gauge("kvstore_namespaces", "Namespaces whose layout the daemon remembers (at most "
                                "max_namespaces; the least recently put forgotten beyond)", registry=r)
        self.capacity_bytes = Gauge("kvstore_capacity_bytes", "Bytes a tier may hold (0: unbounded)", ["tier"],
                                    registry=r)
        self.rpc_seconds = Histogram("kvstore_rpc_seconds", "Time the daemon spent on an RPC, by method", ["method"],
                                     buckets=(25e-6, 50e-6, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                                              0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)

    @staticmethod
    def value(counter: Counter, **labels: str) -> int:
        metric = counter.labels(**labels) if labels else counter
        return int(metric._value.get())

    def total(self, counter: Counter) -> int:
        """A labelled counter summed over its labels."""
        return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))
