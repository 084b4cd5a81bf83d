"""The serving benchmark's arithmetic (bench/serving.py): percentiles, per-run summaries, which QPS
an engine sustains, and issue #41's targets as ratios measured in the same run. Plain Python: the
tests run it on hand-built records under the main Python.

Definitions:

- TTFT: send -> first streamed token; ITL: the gaps between a request's tokens.
- completed rate: requests that finished / (last end - first send); output tokens/s alike.
- offered rate: requests / (the span of their arrivals + one mean gap 1/QPS), the rate the
  seeded Poisson sample really offered (a few dozen arrivals stray from the nominal QPS).
- an engine *sustains* a QPS point when its completed rate is at least ``SUSTAIN_RATE`` x the
  offered rate and its TTFT p50 is at most ``sustain_factor`` x the uncontended cold TTFT (the
  probe request of vLLM alone: one context-sized prompt on the idle server). Past that point
  requests queue faster than they finish.
- vLLM alone *saturates* at the QPS points it does not sustain; the throughput target is taken at
  the highest of them, where each engine runs at its own capacity (at the first such point, a
  sweep in steps of 2x caps the ratio at the offered rate over vLLM's capacity: below 2x).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

SUSTAIN_RATE = 0.9
TARGETS = {"ttft_vs_vllm": 3.0, "throughput_vs_vllm": 1.5, "no_reuse_throughput": 0.95,
           "no_reuse_ttft": 1.05, "ttft_vs_resident": 1.5}
KVSTORE_ENGINES = ("kvstore-cpu", "kvstore-disk")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[dict], qps: float) -> dict:
    """One run's figures from its per-request records (see serving_engines.stream_completion)."""
    done = [r for r in records if r["error"] is None and r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in done]
    later = [r["ttft_s"] for r in done if r["round"] >= 2]
    itl = [gap for r in done for gap in r["itl_s"]]
    span = (max(r["end_s"] for r in done) - min(r["sent_s"] for r in done)) if done else 0.0
    arrivals = sorted(r["arrival_s"] for r in records)
    offered = len(records) / (arrivals[-1] - arrivals[0] + 1.0 / qps) if records else 0.0
    prompt = sum(r["prompt_tokens"] for r in done)
    cached = sum(r["cached_tokens"] or 0 for r in done)
    return {
        "requests": len(records), "completed": len(done), "errors": len(records) - len(done),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "ttft_rounds2_p50_s": percentile(later, 50), "ttft_rounds2_p90_s": percentile(later, 90),
        "rounds2_requests": len(later),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "offered_rps": offered, "completed_rps": len(done) / span if span > 0 else 0.0,
        "output_tps": sum(r["output_tokens"] for r in done) / span if span > 0 else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_ratio": cached / prompt if prompt else 0.0,
        "held_s_max": max((r["sent_s"] - r["arrival_s"] for r in records), default=0.0),
    }


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


def by_label(samples: list[tuple[str, dict[str, str], float]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, ls, v in samples:
        if n == name and label in ls:
            out[ls[label]] = out.get(ls[label], 0.0) + v
    return out


def cache_figures(vllm_before: list, vllm_after: list, daemon_before: list | None, daemon_after: list | None,
                  trace_rows: list[dict], prompt_tokens: int) -> dict:
    """A run's cache figures from Prometheus samples taken before and after its workload (vLLM's
    and, with kvstore, the daemon's) and the connector's trace lines of the workload.

    Hits are tokens over the prompt tokens sent: vLLM's own prefix cache
    (``vllm:prefix_cache_hits``) and kvstore's (``vllm:external_prefix_cache_hits``, what vLLM
    loaded through the connector; the trace's hit blocks' tokens beside it). Bytes: block bytes
    into and out of the daemon's tiers (``kvstore_bytes_in`` / ``_out``), in MB; blocks the connector
    skipped storing because its save queue was behind (``kvstore_client_stores_skipped``, as reported)."""
    def delta(before: list, after: list, name: str) -> float:
        return total(after, name) - total(before, name)

    def tiers(name: str) -> dict[str, float]:
        old = by_label(daemon_before, name, "tier")
        return {tier: value - old.get(tier, 0.0) for tier, value in by_label(daemon_after, name, "tier").items()}

    local = delta(vllm_before, vllm_after, "vllm:prefix_cache_hits_total")
    external = delta(vllm_before, vllm_after, "vllm:external_prefix_cache_hits_total")
    lookups = [row["lookup_s"] for row in trace_rows if isinstance(row.get("lookup_s"), (int, float))]
    traced = sum(sum(b.get("tokens", 0) for b in (row.get("blocks") or [])[: int(row.get("hits") or 0)])
                 for row in trace_rows)
    daemon = daemon_after is not None
    bytes_in, bytes_out = (tiers("kvstore_bytes_in_total"), tiers("kvstore_bytes_out_total")) if daemon else ({}, {})
    return {
        "vllm_hit_tokens": local, "kvstore_hit_tokens": external,
        "vllm_hit_ratio": local / prompt_tokens if prompt_tokens else 0.0,
        "kvstore_hit_ratio": external / prompt_tokens if prompt_tokens else 0.0,
        "preemptions": delta(vllm_before, vllm_after, "vllm:num_preemptions_total"),
        "kvstore_trace_hit_tokens": traced if trace_rows else None,
        "daemon_lookup_hit_keys": delta(daemon_before, daemon_after, "kvstore_lookup_hits_total") if daemon else None,
        "stores_skipped": delta(daemon_before, daemon_after, "kvstore_client_stores_skipped_total") if daemon else None,
        "bytes_in_mb": sum(bytes_in.values()) / 1e6 if daemon else None,
        "bytes_out_mb": sum(bytes_out.values()) / 1e6 if daemon else None,
        "bytes_in_by_tier": bytes_in, "bytes_out_by_tier": bytes_out,
        "lookup_p50_s": percentile(lookups, 50), "lookup_p99_s": percentile(lookups, 99), "lookups": len(lookups)}


def sustains(summary: dict, cold_ttft_s: float, sustain_factor: float) -> bool:
    return (summary["completed_rps"] >= SUSTAIN_RATE * summary["offered_rps"]
            and summary["ttft_p50_s"] is not None and summary["ttft_p50_s"] <= sustain_factor * cold_ttft_s)


def median_summaries(summaries: list[dict]) -> dict:
    """Each figure's median over repeats (None where a repeat has none)."""
    out = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float)) and not isinstance(s[key], bool)]
        out[key] = statistics.median(values) if values else None
    return out


@dataclass(frozen=True)
class Target:
    name: str
    rule: str
    value: float | None     # the measured ratio (None: not measurable in this run)
    bound: float
    at_least: bool          # value >= bound (else value <= bound)
    detail: str

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def line(self) -> str:
        state = {True: "met", False: "NOT MET", None: "not measured"}[self.met]
        value = "-" if self.value is None else f"{self.value:.2f}x"
        return f"target {self.rule}: {value} {state} ({self.detail})"

    def as_dict(self) -> dict:
        return {**asdict(self), "met": self.met}


def evaluate_targets(table: dict[str, dict[float, dict]], mode: str, cold_ttft_s: float | None,
                     sustain_factor: float, fits: dict[str, bool]) -> list[Target]:
    """Issue #41's targets from ``table[engine][qps]`` (median summaries). ``fits[engine]``: the
    working set fits that kvstore engine's tiers."""
    kv = [e for e in KVSTORE_ENGINES if e in table]
    base = table.get("vllm")
    targets: list[Target] = []
    if not kv or base is None or cold_ttft_s is None:
        return [Target("all", "issue #41 targets", None, 0.0, True,
                       "need vllm and kvstore-cpu or kvstore-disk in --engines")]
    qps_points = sorted(base)
    held = [q for q in qps_points if sustains(base[q], cold_ttft_s, sustain_factor)]
    lost = [q for q in qps_points if q not in held]
    bound = f"sustains: done >= {SUSTAIN_RATE:g}x offered and TTFT p50 <= {sustain_factor:g} x {cold_ttft_s:.2f} s cold"

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    if mode == "no-reuse":
        for e in kv:
            throughput = _ratios(table[e], base, "completed_rps", qps_points)
            ttft = _ratios(table[e], base, "ttft_p50_s", qps_points)
            worst_tp, worst_ttft = min(throughput, default=(None, None)), max(ttft, default=(None, None))
            targets.append(Target(f"{e}:no_reuse_throughput", f"{e} no-reuse throughput >= 0.95x vLLM alone",
                                  worst_tp[0], TARGETS["no_reuse_throughput"], True,
                                  f"the worst QPS point, {_q(worst_tp[1])}"))
            targets.append(Target(f"{e}:no_reuse_ttft", f"{e} no-reuse TTFT p50 <= 1.05x vLLM alone",
                                  worst_ttft[0], TARGETS["no_reuse_ttft"], False,
                                  f"the worst QPS point, {_q(worst_ttft[1])}"))
        return targets
    for e in kv:
        if held:
            q = held[-1]
            value = ratio(base[q]["ttft_p50_s"], table[e].get(q, {}).get("ttft_p50_s"))
            detail = (f"QPS {q:g}, the highest vLLM alone sustains: vLLM {base[q]['ttft_p50_s']:.3f} s, "
                      f"{e} {_s(table[e].get(q, {}).get('ttft_p50_s'))}; {bound}")
        else:
            value, detail = None, f"vLLM alone sustains none of the QPS points ({bound}); lower --qps"
        targets.append(Target(f"{e}:ttft_vs_vllm", f"{e} TTFT p50 >= 3x lower than vLLM alone", value,
                              TARGETS["ttft_vs_vllm"], True, detail))
        if lost:
            q = lost[-1]
            value = ratio(table[e].get(q, {}).get("completed_rps"), base[q]["completed_rps"])
            detail = (f"QPS {q:g}, the highest where vLLM alone saturates: vLLM {base[q]['completed_rps']:.3f} req/s, "
                      f"{e} {_f(table[e].get(q, {}).get('completed_rps'))} req/s")
        else:
            value, detail = None, "vLLM alone sustains every QPS point; raise --qps"
        targets.append(Target(f"{e}:throughput_vs_vllm", f"{e} throughput >= 1.5x vLLM alone", value,
                              TARGETS["throughput_vs_vllm"], True, detail))
        if "resident" in table and fits.get(e):
            res = table["resident"]
            points = [q for q in sorted(res) if sustains(res[q], cold_ttft_s, sustain_factor) and q in table[e]]
            ratios = _ratios(table[e], res, "ttft_p50_s", points)
            worst = max(ratios, default=(None, None))
            each = ", ".join(f"{q:g}: {r:.2f}x" for r, q in ratios)
            detail = (f"the worst of the QPS points resident sustains, at QPS {worst[1]:g}; each: {each}" if ratios
                      else "resident sustains no QPS point")
            targets.append(Target(f"{e}:ttft_vs_resident", f"{e} TTFT p50 within 1.5x of resident", worst[0],
                                  TARGETS["ttft_vs_resident"], False, detail))
    return targets


def _ratios(engine: dict[float, dict], base: dict[float, dict], key: str, points: list[float]) -> list[tuple]:
    """(engine / base, qps) of ``key`` at each of ``points`` both measured."""
    out = []
    for q in points:
        a, b = engine.get(q, {}).get(key), base.get(q, {}).get(key)
        if a is not None and b:
            out.append((a / b, q))
    return out


def _q(qps: float | None) -> str:
    return "-" if qps is None else f"{qps:g}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
