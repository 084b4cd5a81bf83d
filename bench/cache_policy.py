"""Trace-driven cache-policy simulator (issue #41): token hit ratio and bytes written per tier for
eviction and admission policies at several capacities, against the offline optimum.

    python bench/cache_policy.py --synthetic [--users 48 --rounds 8 --zipf 1.0 | --active 8 | --no-reuse]
                                 [--policies lru,prefix-tinylfu-duel] [--json out.json] [--plot out.png]
    python bench/cache_policy.py trace.jsonl [more.jsonl] [--capacities 0.25,0.5,1.0] [--lower 0,2]
    python bench/cache_policy.py ../shared/data/traces/mooncake_conversation_trace.jsonl \
        --policies lru,default,adaptive --capacities 0.05,0.1,0.25 [--token-bytes 23040]

Traces: `bench/cache_trace.py` (format, loader, Mooncake's format as it is, synthetic multi-round QA). Each request is replayed
against a top tier (CPU) of C_top bytes and optionally a lower tier (disk) of C_low bytes:

    lookup  hit = blocks 0..h-1 of the chain, each held by either tier (later ones chain through a miss)
    put     each block of the chain in order, as the engine stores every chunk it computed: touched
            if the top holds it, else written to the top (so a lower-tier hit is promoted; the lower
            copy stays and is touched). The top's victims go down when the lower tier lacks them and
            admission allows; with write-through (the daemon's default) new blocks also go down at
            once, without it only on eviction.

Eviction, the same policy in each tier (`bench/cache_tiers.py` has one class each):
    lru         the daemon today. A chain touched in order leaves its head the oldest, so LRU evicts
                the head first and keeps the rest as dead weight until it ages out too.
    prefix-lru  the least recently used leaf (a block none of whose children the tier holds). Each
                tier counts the children it holds per key and keeps its leaves in a heap: O(log n).
    prefix-tinylfu  prefix-lru behind TinyLFU admission: a block that would force an eviction is stored
                only if a count-min sketch says it was asked for more often than the victim, incumbents
                winning ties; a round's new blocks inherit their held parent's estimate. On a loop
                larger than the tier it keeps a fixed subset, as Belady does; when users come and go
                (sessions, Zipf users who finish) it turns newcomers away and loses to LRU.
    prefix-tinylfu-duel  prefix-tinylfu whose filter is on only while key-only shadows of both, replaying
                every request, show it hitting more (set dueling) and the tier itself hits no less
                than the prefix-lru shadow; otherwise it is prefix-lru. The lower tier's shadows are
                one tier of C_top + C_low.
    segmented   S3-FIFO's idea in LRU segments: probation (half the tier) for new blocks, protected for
                blocks used again, a ghost of probation's victims that come back protected.
    arc         ARC, in bytes; prefix-arc: ARC whose stored or used blocks refresh their held
                ancestors within their own segment (as the daemon's prefix-lru walk does).
    adaptive    prefix-lru or prefix-arc by set dueling: key-only shadows of ARC and LRU on a hashed
                sample of the keys decide which order the tier evicts by (the daemon's ``adaptive``).
    default     the daemon's defaults, whatever they are: `DEFAULT_POLICY` eviction, `DEFAULT_ADMISSION`,
                write-through (so a run names what the daemon does).
    A block admission turns away passes down like a victim (lower tier if it lacks it and admission
    allows, else dropped), unwritten; ``rejections_*`` count them.
Admission to the lower tier, asked at write-through and at demotion alike:
    all         every block (the daemon today)
    reused      blocks requested again after their first put (needs a record of every key seen)
    ghost       the same from a bounded record, keys of the last C_top + C_low bytes of distinct blocks
                asked for: a block reused later would not have stayed in either tier under LRU anyway

The optimum, `belady`: farthest next use over one level of C_top + C_low bytes, the most distinct
bytes the two tiers can hold at once, so a bound on every configuration here (max(C_top, C_low), the
size of strictly inclusive tiers, is none: the lower tier's own evictions, admission and write-back
make the tiers partly exclusive). Every request that uses a child uses its parent first, so
next_use(parent) <= next_use(child); evicting the deeper block on a tie makes Belady evict leaves
first, so what it holds is closed under parents and each block of a chain it holds is a hit. With one
block size and token count, Belady (free not to keep a block) maximises block hits and so token hits.
Tail blocks (fewer tokens and bytes) make it an upper reference, not a proven optimum: it ignores
size, and optimal variable-size caching is NP-hard. Where it reaches the infinite cache's ratio (printed
first: every block's first use misses, nothing else), no policy can do better, so there it is the
optimum exactly: on the Mooncake conversation trace it does at 5%, 10% and 25% (37.4% of tokens).

Capacities: fractions of the working set (bytes of the distinct blocks), each with the top tier alone and
with a lower tier 2x the top: a disk larger than the CPU tier, yet small enough that it must choose.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from cache_tiers import (AdaptiveTier, ARCTier, FrequencySketch, LRUTier, PrefixARCTier, PrefixLRUTier,
                         PrefixTinyLFUDuelTier, PrefixTinyLFUTier, SegmentedTier, SimTier)
from cache_trace import (TOKEN_BYTES, Block, Request, TraceError, load_trace, load_traces, next_uses,
                         synthetic_trace, working_set_bytes)

__all__ = ["simulate", "belady", "Result", "load_trace", "working_set_bytes", "synthetic_trace", "POLICIES",
           "ADMISSIONS"]
PROGRESS_EVERY = 10_000  # requests between progress calls

POLICIES: dict[str, type[SimTier]] = {"lru": LRUTier, "prefix-lru": PrefixLRUTier, "prefix-tinylfu": PrefixTinyLFUTier,
                                     "prefix-tinylfu-duel": PrefixTinyLFUDuelTier, "segmented": SegmentedTier,
                                     "arc": ARCTier, "prefix-arc": PrefixARCTier, "adaptive": AdaptiveTier}
ADMISSIONS = ("all", "reused", "ghost")
#: The model of the daemon's defaults (`kvstore/daemon/config.py`: ``eviction``, ``admission``), so a
#: run of ``--policies default`` names what the daemon does; keep it equal to them (tests/test_cache_policy.py).
DEFAULT = "default"
DEFAULT_POLICY, DEFAULT_ADMISSION = "prefix-lru", "all"


class Admission:
    """`see` gets each request before its puts, `admits` is asked at write-through and demotion. A block's
    latest request decides (in a daemon, a flag on the held block); ``reused`` is an unbounded ``ghost``."""

    def __init__(self, name: str, window_bytes: int) -> None:
        if name not in ADMISSIONS:
            raise ValueError(f"unknown admission {name!r}; choose from {', '.join(ADMISSIONS)}")
        self.name = name
        self._window = window_bytes if name == "ghost" else None
        self._seen: OrderedDict[str, int] = OrderedDict()    # key -> bytes, least recently seen first
        self._seen_bytes = 0
        self._reused: set[str] = set()

    def see(self, request: Request) -> None:
        if self.name == "all":
            return
        for block in request.blocks:
            if block.key in self._seen:
                self._reused.add(block.key)
                self._seen.move_to_end(block.key)
            else:
                self._reused.discard(block.key)
                self._seen[block.key] = block.nbytes
                self._seen_bytes += block.nbytes
        while self._window is not None and self._seen_bytes > self._window:
            self._seen_bytes -= self._seen.popitem(last=False)[1]

    def admits(self, key: str) -> bool:
        return self.name == "all" or key in self._reused


@dataclass
class Result:
    """One replay. Bytes written to the top include promotions; evictions count blocks."""
    policy: str
    capacity: int
    lower_capacity: int = 0
    admission: str = "all"
    write_through: bool = True
    total_tokens: int = 0
    hit_tokens: int = 0
    lower_hit_tokens: int = 0       # of hit_tokens, those only the lower tier held
    bytes_written_top: int = 0
    bytes_written_lower: int = 0
    evictions_top: int = 0
    evictions_lower: int = 0
    rejections_top: int = 0         # blocks admission turned away (passed down or dropped, not written)
    rejections_lower: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def lower_bytes_per_hit_token(self) -> float | None:
        """Lower-tier bytes written per token hit in either tier; None without hits."""
        return self.bytes_written_lower / self.hit_tokens if self.hit_tokens else None

    @property
    def label(self) -> str:
        if not self.lower_capacity or self.policy in ("belady", DEFAULT):
            return self.policy
        return f"{self.policy} {'through' if self.write_through else 'back'} {self.admission}"

    def to_json(self) -> dict:
        derived = {"hit_ratio": self.hit_ratio, "lower_bytes_per_hit_token": self.lower_bytes_per_hit_token}
        return asdict(self) | derived


def simulate(requests: Sequence[Request], policy: str, capacity: int, lower_capacity: int = 0,
             admission: str = "all", write_through: bool = True,
             on_evict: Callable[[SimTier, Block], None] | None = None, check_integrity: bool = False,
             progress: Callable[[int], None] | None = None) -> Result:
    """Replay ``requests`` against a top tier of ``capacity`` bytes and, if ``lower_capacity``, a
    lower tier, both evicting by ``policy`` (see `POLICIES`); ``admission`` (see `ADMISSIONS`) gates
    the lower tier. ``check_integrity``: check both tiers after every request (tests).
    ``progress(requests done)`` is called every `PROGRESS_EVERY` requests."""
    if policy == DEFAULT:
        if (admission, write_through) != (DEFAULT_ADMISSION, True):
            raise ValueError(f"{DEFAULT!r} is the daemon's defaults: admission {DEFAULT_ADMISSION!r}, write-through")
    elif policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; choose from {', '.join((DEFAULT, *POLICIES))}")
    tier_class = POLICIES[DEFAULT_POLICY if policy == DEFAULT else policy]
    frequency = None
    if tier_class.needs_frequency:  # sized by the blocks both tiers hold, in the trace's largest blocks
        largest = max((b.nbytes for r in requests for b in r.blocks), default=1) or 1
        frequency = FrequencySketch(max(1, (capacity + lower_capacity) // largest))
    top = tier_class("top", capacity, on_evict, frequency)
    lower = (tier_class("lower", lower_capacity, on_evict, frequency, reach=capacity + lower_capacity)
             if lower_capacity > 0 else None)
    tiers = [tier for tier in (top, lower) if tier is not None]
    admit = Admission(admission, capacity + lower_capacity)
    result = Result(policy, capacity, lower_capacity, admission, write_through)
    for done, request in enumerate(requests, start=1):
        if frequency is not None:
            frequency.record(request)  # at lookup: every block the request names, hit or miss
        _replay(request, top, lower, admit, write_through, result)
        for tier in tiers if check_integrity else ():
            tier.check_integrity()
        if progress is not None and done % PROGRESS_EVERY == 0:
            progress(done)
    result.bytes_written_top, result.evictions_top, result.rejections_top = \
        top.bytes_written, top.evictions, top.rejections
    if lower is not None:
        result.bytes_written_lower, result.evictions_lower, result.rejections_lower = \
            lower.bytes_written, lower.evictions, lower.rejections
    return result


def _replay(request: Request, top: SimTier, lower: SimTier | None, admit: Admission, write_through: bool,
            result: Result) -> None:
    hit = served = top_served = 0  # blocks hit; their tokens; tokens of the leading blocks the top holds
    for block in request.blocks:
        if block.key not in top:
            if lower is None or block.key not in lower:
                break
            result.lower_hit_tokens += block.tokens
        elif served == top_served:
            top_served += block.tokens
        served += block.tokens
        hit += 1
    result.hit_tokens += served
    result.total_tokens += request.tokens
    admit.see(request)
    top.see(request, top_served)
    if lower is not None:
        lower.see(request, served)
    for i, block in enumerate(request.blocks):
        if block.key in top:
            top.touch(block)
            continue
        if i < hit and lower is not None and block.key in lower:  # (unless demotions pushed it out since)
            lower.touch(block)  # served from the lower tier, promoted now
        for victim in top.insert(block):
            if lower is not None and victim.key not in lower and admit.admits(victim.key):
                lower.insert(victim)  # its own victims leave the cache
        if write_through and lower is not None and block.key not in lower and admit.admits(block.key):
            lower.insert(block)


def belady(requests: Sequence[Request], capacity: int, progress: Callable[[int], None] | None = None) -> Result:
    """Farthest-next-use eviction over one level of ``capacity`` bytes, deeper block first on a tie. An
    upper reference (module docstring); its bytes written count every miss, even one it drops at once."""
    next_use = next_uses(requests)
    result = Result("belady", capacity)
    held: dict[str, tuple[int, int, int]] = {}    # key -> (its next use, its depth, its bytes)
    heap: list[tuple[int, int, str]] = []         # (-next use, -depth, key); stale entries skipped
    used = 0
    for r, request in enumerate(requests):
        for block in request.blocks:
            if block.key not in held:
                break
            result.hit_tokens += block.tokens
        result.total_tokens += request.tokens
        for depth, (block, use) in enumerate(zip(request.blocks, next_use[r])):
            if block.key not in held:
                if block.nbytes > capacity:
                    continue
                used += block.nbytes
                result.bytes_written_top += block.nbytes
            held[block.key] = (use, depth, block.nbytes)
            heapq.heappush(heap, (-use, -depth, block.key))
        while used > capacity:
            neg_use, neg_depth, key = heapq.heappop(heap)
            if held.get(key, (None, None))[:2] == (-neg_use, -neg_depth):
                used -= held.pop(key)[2]
                result.evictions_top += 1
        if len(heap) > 4 * len(held) + 1024:  # stale entries outnumber live ones: rebuild
            heap = [(-use, -depth, key) for key, (use, depth, _) in held.items()]
            heapq.heapify(heap)
        if progress is not None and (r + 1) % PROGRESS_EVERY == 0:
            progress(r + 1)
    return result


def run_grid(requests: Sequence[Request], fractions: Sequence[float], lowers: Sequence[float],
             policies: Sequence[str], admissions: Sequence[str]) -> list[tuple[float, float, Result]]:
    """(top / working set, lower / top, result) of the optimum and of each policy, write mode and admission."""
    working_set = working_set_bytes(requests)
    runs = [(fraction, lower, policy, through, admission) for fraction in fractions for lower in lowers
            for policy in ("belady", *policies)
            for through in ((True, False) if lower and policy not in ("belady", DEFAULT) else (True,))
            for admission in (admissions if lower and policy not in ("belady", DEFAULT) else
                              (DEFAULT_ADMISSION if policy == DEFAULT else "all",))]
    results = []
    for i, (fraction, lower, policy, through, admission) in enumerate(runs, start=1):
        top = round(fraction * working_set)

        def progress(done: int, run: int = i) -> None:  # called on long traces only
            print(f"\rrun {run}/{len(runs)}: {done}/{len(requests)} requests", end="", file=sys.stderr)
        if policy == "belady":
            result = belady(requests, top + round(lower * top), progress)
        else:
            result = simulate(requests, policy, top, round(lower * top), admission, through, progress=progress)
        results.append((fraction, lower, result))
    if len(requests) >= PROGRESS_EVERY:
        print(file=sys.stderr)
    return results


def table(results: Sequence[tuple[float, float, Result]]) -> str:
    """Points against the optimum and against lru in the same configuration, lower bytes per hit token."""
    best = {(f, lower): r.hit_ratio for f, lower, r in results if r.policy == "belady"}
    lru = {(f, lower, r.write_through, r.admission): r.hit_ratio for f, lower, r in results if r.policy == "lru"}
    lines = [f"{'top':>5} {'lower':>5}  {'policy':<36} {'hit %':>6} {'vs opt':>7} {'vs lru':>7} "
             f"{'top GB':>8} {'lower GB':>9} {'lower B/hit tok':>15}"]
    for fraction, lower, r in results:
        vs_lru = lru.get((fraction, lower, r.write_through, r.admission)) if r.policy != "belady" else None
        per_hit = r.lower_bytes_per_hit_token if r.policy != "belady" and lower else None
        lines.append(f"{fraction:>5.0%} {lower:>4g}x  {r.label:<36} {100 * r.hit_ratio:6.1f} "
                     f"{100 * (r.hit_ratio - best[fraction, lower]):+7.1f} "
                     f"{'' if vs_lru is None else f'{100 * (r.hit_ratio - vs_lru):+.1f}':>7} "
                     f"{r.bytes_written_top / 1e9:8.2f} {r.bytes_written_lower / 1e9:9.2f} "
                     f"{'-' if per_hit is None else f'{per_hit:,.0f}':>15}")
    return "\n".join(lines)


_LINE_STYLES = ("-", ":", "-.", (0, (5, 1)), (0, (1, 3)), (0, (3, 1, 1, 1)))  # one per write mode and admission


def plot(results: Sequence[tuple[float, float, Result]], path: str) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("no plot: matplotlib is not installed", file=sys.stderr)
        return
    lowers = sorted({lower for _, lower, _ in results})
    figure = Figure(figsize=(6 * len(lowers), 4.5), layout="constrained")
    for axes, lower in zip(figure.subplots(1, len(lowers), squeeze=False)[0], lowers):
        curves: dict[str, list[tuple[float, float]]] = {}
        for fraction, _, r in (row for row in results if row[1] == lower):
            curves.setdefault(r.label, []).append((fraction, 100 * r.hit_ratio))
        modes = sorted({label.partition(" ")[2] for label in curves})  # a line style each, a colour per policy
        policies = sorted({label.partition(" ")[0] for label in curves} - {"belady"})
        for label, points in curves.items():
            policy, _, mode = label.partition(" ")
            style = {"color": "black", "linestyle": "--"} if policy == "belady" else \
                {"marker": "o", "color": f"C{policies.index(policy)}",
                 "linestyle": _LINE_STYLES[modes.index(mode) % len(_LINE_STYLES)]}
            axes.plot(*zip(*sorted(points)), label=label, **style)
        axes.set(title="top tier only" if not lower else f"lower tier {lower:g}x the top",
                 xlabel="top tier, fraction of working set", ylabel="token hit ratio %")
        axes.legend(fontsize="small")
    figure.savefig(path)


def _numbers(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]  # argparse reports a ValueError as an invalid value
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("sizes must be >= 0")
    return values


def _names(known: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = text.split(",")
        if unknown := [name for name in names if name not in known]:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        return names
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", help="JSON-lines traces (merged by arrival time)")
    parser.add_argument("--synthetic", action="store_true", help="replay a synthetic multi-round QA trace instead")
    parser.add_argument("--users", type=int, default=48, help="synthetic: users (default 48)")
    parser.add_argument("--rounds", type=int, default=8, help="synthetic: rounds per user (default 8)")
    parser.add_argument("--zipf", type=float, help="synthetic: users drawn with Zipf weights (default: round-robin)")
    parser.add_argument("--context-blocks", type=int, default=16, help="synthetic: blocks of each user's context")
    parser.add_argument("--question-blocks", type=int, default=1, help="synthetic: blocks each round adds")
    parser.add_argument("--active", type=int, help="synthetic: users come in sessions, this many at once")
    parser.add_argument("--system-blocks", type=int, default=2,
                        help="synthetic: blocks of the prompt every request shares (an agent's tool prompt)")
    parser.add_argument("--scans", type=float, default=0.0,
                        help="synthetic: this fraction of requests are one-off documents (default 0)")
    parser.add_argument("--no-reuse", action="store_true", help="synthetic: every block new (nothing can hit)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: seed of the users' order")
    parser.add_argument("--policies", type=_names((DEFAULT, *POLICIES)), default=list(POLICIES),
                        help=f"eviction policies to replay besides belady (default all: {','.join(POLICIES)}); "
                             f"'{DEFAULT}': the daemon's default eviction and admission ({DEFAULT_POLICY}, "
                             f"{DEFAULT_ADMISSION}, write-through)")
    parser.add_argument("--admissions", type=_names(ADMISSIONS), default=list(ADMISSIONS),
                        help=f"lower-tier admissions to replay (default all: {','.join(ADMISSIONS)})")
    parser.add_argument("--capacities", type=_numbers, default=[0.25, 0.5, 1.0],
                        help="top tier sizes as fractions of the working set (default 0.25,0.5,1.0)")
    parser.add_argument("--lower", type=_numbers, default=[0.0, 2.0],
                        help="lower tier sizes as multiples of the top's; 0 = top only (default 0,2)")
    parser.add_argument("--token-bytes", type=int, default=TOKEN_BYTES,
                        help=f"KV bytes a token, for traces without bytes (Mooncake's; default {TOKEN_BYTES:,}, "
                             "SmolLM2-135M)")
    parser.add_argument("--json", metavar="PATH", help="write every number as JSON")
    parser.add_argument("--plot", metavar="PATH", help="plot hit ratio against capacity (PNG, needs matplotlib)")
    args = parser.parse_args(argv)
    if args.synthetic == bool(args.traces):
        parser.error("give trace files or --synthetic")
    try:
        requests = (synthetic_trace(args.users, args.rounds, args.context_blocks, args.question_blocks, args.seed,
                                    shared_system_blocks=args.system_blocks, no_reuse=args.no_reuse, zipf=args.zipf,
                                    active=args.active, scans=args.scans)
                    if args.synthetic else load_traces(args.traces, args.token_bytes))
    except (OSError, TraceError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    working_set, total_tokens = working_set_bytes(requests), sum(r.tokens for r in requests)
    print(f"{len(requests)} requests, {sum(len(r.blocks) for r in requests)} block lookups, {total_tokens} tokens; "
          f"working set {working_set / 1e9:.2f} GB in {len({b.key for r in requests for b in r.blocks})} blocks")
    if live := [r for r in requests if r.hits is not None]:
        live_tokens = sum(sum(b.tokens for b in r.blocks[:r.hits]) for r in live)
        print(f"live system: {100 * live_tokens / max(1, sum(r.tokens for r in live)):.1f}% of tokens hit in "
              f"{len(live)} recorded lookups; vLLM's own cache held {sum(r.local_tokens or 0 for r in live)} tokens")
    print(f"an infinite cache hits {100 * belady(requests, working_set).hit_ratio:.1f}% of tokens (first uses miss)")
    results = run_grid(requests, args.capacities, args.lower, args.policies, args.admissions)
    print(table(results))
    if args.json:
        runs = [{"top_fraction": f, "lower_multiple": lower, **r.to_json()} for f, lower, r in results]
        with open(args.json, "w") as out:
            json.dump({"requests": len(requests), "total_tokens": total_tokens, "working_set_bytes": working_set,
                       "runs": runs}, out, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
