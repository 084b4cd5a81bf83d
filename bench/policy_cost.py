"""What an eviction policy costs the daemon's event loop (docs/policy.md, "Frequency: adaptive"):
chained Puts of small blocks into an in-process `BlockStore` whose CPU tier holds ``--tier`` blocks
(past the first tier-ful, every Put evicts), a Get of an older chain after each chain, timed per
policy in rounds that alternate which runs first; prints each policy's median time per Put against
``prefix-lru``'s, and every round's ratio.

    python bench/policy_cost.py [--puts 3000] [--tier 256] [--rounds 6] [--policies adaptive,lru]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.block import BlockHeader, payload_checksum  # noqa: E402
from kvstore.daemon.config import EVICTION_POLICIES  # noqa: E402
from kvstore.daemon.metrics import Metrics  # noqa: E402
from kvstore.daemon.placement import BlockStore  # noqa: E402
from kvstore.keys import KVLayout  # noqa: E402
from tiers.cpu import CpuTier  # noqa: E402

BASELINE = "prefix-lru"
CHAIN = 20          # blocks a chain (one request's Put)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16")
TOKENS = 4


def make_blocks(n: int) -> list[tuple[BlockHeader, memoryview]]:
    payload = bytes(LAYOUT.block_bytes(TOKENS))
    checksum = payload_checksum(payload)
    return [(BlockHeader(key=i.to_bytes(16, "little"), namespace=b"n" * 16, layout=LAYOUT, tokens=TOKENS,
                         payload_len=len(payload), checksum=checksum), memoryview(payload)) for i in range(n)]


async def replay(blocks: list[tuple[BlockHeader, memoryview]], tier_blocks: int, eviction: str) -> float:
    """Seconds to Put every chain (with parents) and Get the chain five before each."""
    extent = (blocks[0][0].block_len + 63) // 64 * 64
    store = BlockStore([CpuTier(tier_blocks * extent + 4096)], Metrics(), write_through=False, eviction=eviction)
    store.start()
    start = time.perf_counter()
    for first in range(0, len(blocks), CHAIN):
        parent = b""
        for header, payload in blocks[first:first + CHAIN]:
            await store.put(header, payload, parent=parent)
            parent = header.key
        older = blocks[max(0, first - 5 * CHAIN):max(0, first - 4 * CHAIN)]
        await store.reads.get_many_into([(h.key, memoryview(bytearray(h.payload_len))) for h, _ in older])
    elapsed = time.perf_counter() - start
    await store.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--puts", type=int, default=3000, help="blocks put in all (default 3000)")
    parser.add_argument("--tier", type=int, default=256, help="blocks the CPU tier holds (default 256)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every policy (default 6)")
    parser.add_argument("--policies", default="adaptive", help=f"compared with {BASELINE} (default adaptive)")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    if unknown := [p for p in policies if p not in EVICTION_POLICIES]:
        parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(EVICTION_POLICIES)}")
    blocks = make_blocks(args.puts)
    times: dict[str, list[float]] = {p: [] for p in (BASELINE, *policies)}
    order = list(times)
    for r in range(args.rounds):
        for policy in (order if r % 2 == 0 else order[::-1]):
            times[policy].append(asyncio.run(replay(blocks, args.tier, policy)))
    base = statistics.median(times[BASELINE])
    print(f"{args.puts} Puts into a tier of {args.tier} blocks, {args.rounds} rounds: {BASELINE} "
          f"{1e6 * base / args.puts:.1f} us a Put (its Gets included)")
    for policy in policies:
        ratios = [t / b for t, b in zip(times[policy], times[BASELINE])]
        print(f"  {policy}: {statistics.median(times[policy]) / base:.3f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
