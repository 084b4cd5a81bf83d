"""Eviction and admission that know prefix chains (docs/policy.md): in process on real tiers, and
through a real daemon with the client's parent keys."""

import asyncio
import random

import pytest

from kvstore.daemon.metrics import Metrics
from kvstore.daemon.placement import BlockStore
from kvstore.daemon.residency import MAX_WALK
from tests.conftest import ROOT
from tests.test_placement import BLOCK, blocks
from tiers.cpu import CpuTier
from tiers.disk import DiskTier


def store_of(tmp_path, cpu_blocks, disk_blocks=0, **kw) -> BlockStore:
    tiers = [CpuTier(cpu_blocks * BLOCK + 4096)]
    if disk_blocks:
        tiers.append(DiskTier(tmp_path, disk_blocks * BLOCK, fsync=False))
    return BlockStore(tiers, Metrics(), write_through=bool(disk_blocks), **kw)


async def put_chain(store, chain):
    parent = b""
    for header, payload in chain:
        await store.put(header, payload, parent=parent)
        parent = header.key


async def get_all(store, chain):
    dests = [(h.key, memoryview(bytearray(h.payload_len))) for h, _ in chain]
    return await store.reads.get_many_into(dests)


@pytest.mark.parametrize("eviction, expected_hits", [("prefix-lru", 3), ("lru", 0)])
def test_a_full_tier_evicts_a_chains_end_not_its_start(tmp_path, eviction, expected_hits):
    """Five chained blocks in a tier of five; two more unrelated blocks come. LRU evicts the chain's
    first two blocks, which leaves three blocks no lookup can reach; prefix-lru evicts its last two."""
    async def scenario():
        store = store_of(tmp_path, cpu_blocks=5, eviction=eviction)
        store.start()
        chain, other = blocks(5, start=100), blocks(2, start=200)
        await put_chain(store, chain)
        for header, payload in other:
            await store.put(header, payload)
        assert store.lookup([h.key for h, _ in chain]).hits == expected_hits
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


@pytest.mark.parametrize("eviction", ["prefix-lru", "lru"])
def test_a_read_chain_keeps_its_prefix_through_later_puts(tmp_path, eviction):
    """Two chains; the older is read again (one Get, first to last), then a third chain of three
    comes. Plain LRU has the read chain's first block oldest and breaks it at once."""
    async def scenario():
        store = store_of(tmp_path, cpu_blocks=8, eviction=eviction)
        store.start()
        a, b, c = blocks(4, start=300), blocks(4, start=310), blocks(3, start=320)
        await put_chain(store, a)
        await put_chain(store, b)
        assert all(r is not None for r in await get_all(store, a))
        await put_chain(store, c)  # evicts three blocks: b's (older) under both policies
        assert store.lookup([h.key for h, _ in a]).hits == 4
        hits_b = store.lookup([h.key for h, _ in b]).hits
        assert hits_b == (1 if eviction == "prefix-lru" else 0)
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


def test_prefix_lru_never_evicts_a_block_whose_child_stays(tmp_path):
    """Random chains sharing prefixes, random reads, a tier far smaller than them: after every
    operation each block the tier holds has its parent there too (no block is kept without the
    blocks before it), except where the parent was never stored."""
    async def scenario():
        rng = random.Random(7)
        store = store_of(tmp_path, cpu_blocks=12)
        store.start()
        pool = blocks(60, start=1000)
        parent_of: dict[bytes, bytes] = {}
        chains: list[list] = []
        for step in range(80):
            if chains and rng.random() < 0.4:
                chain = rng.choice(chains)
                await get_all(store, chain[: rng.randint(1, len(chain))])
            else:
                base = rng.choice(chains)[: rng.randint(1, 3)] if chains and rng.random() < 0.5 else []
                chain = base + rng.sample(pool, rng.randint(1, 4))
                if len({h.key for h, _ in chain}) < len(chain):
                    continue
                parent = b""
                for header, payload in chain:
                    # a key is one content address: its parent never changes
                    if parent_of.setdefault(header.key, parent) != parent:
                        break
                    await store.put(header, payload, parent=parent)
                    parent = header.key
                else:
                    chains.append(chain)
            held = set(store.residency[0])
            orphans = [k for k in held if parent_of.get(k) and parent_of[k] not in held]
            assert not orphans, f"step {step}: {len(orphans)} blocks kept without their parent"
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


def test_a_forged_parent_cycle_or_deep_chain_costs_a_bounded_walk(tmp_path):
    async def scenario():
        store = store_of(tmp_path, cpu_blocks=4)
        store.start()
        (a, pa), (b, pb) = blocks(2, start=400)
        await store.put(a, pa, parent=b.key)
        await store.put(b, pb, parent=a.key)  # a cycle: a -> b -> a
        residency = store.residency
        assert len(residency._touch_ancestors(0, a.key)) == MAX_WALK
        residency.touch_chain(0, [a.key, b.key])
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


def test_a_put_that_stores_nothing_leaves_no_parent_link(tmp_path):
    """A Put refused because every block is pinned keeps nothing of its parent hint: refused Puts
    cannot grow the daemon."""
    from tiers.base import TierFullError

    async def scenario():
        store = store_of(tmp_path, cpu_blocks=2)
        store.start()
        held = blocks(2, start=700)
        for header, payload in held:
            await store.put(header, payload)
        store.pin([h.key for h, _ in held])
        for header, payload in blocks(5, start=710):
            with pytest.raises(TierFullError):
                await store.put(header, payload, parent=held[0][0].key)
        assert not store.residency._parent
        await store.close()
    asyncio.run(scenario())


def test_one_put_call_shares_one_walk_budget(tmp_path):
    """Many blocks in one call, each naming the end of a deep chain as parent, walk no more than the
    call's budget together (the server gives each Put one `WalkBudget`): a hostile Put of thousands
    of tiny blocks cannot hold the event loop for thousands of walks."""
    from kvstore.daemon.residency import WalkBudget

    async def scenario():
        store = store_of(tmp_path, cpu_blocks=60)
        store.start()
        chain, extra = blocks(40, start=800), blocks(10, start=900)
        await put_chain(store, chain)
        walk = WalkBudget(left=50)
        for header, payload in extra:
            await store.put(header, payload, parent=chain[-1][0].key, walk=walk)
        assert walk.left == 0  # the first walk took 40 steps (the whole chain), the second the last 10
        order = list(store.residency[0])
        assert order.index(extra[1][0].key) < order.index(chain[30][0].key)  # the second walk reached it
        assert order.index(chain[29][0].key) < order.index(extra[1][0].key)  # ... and stopped before this
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


@pytest.mark.parametrize("admission", ["all", "reused"])
def test_reused_admission_writes_down_only_blocks_read_again(tmp_path, admission):
    """Write-through under "reused": a block nobody reads stays out of the disk tier, and is not
    demoted when the CPU tier evicts it; a block read once is copied down then."""
    async def scenario():
        store = store_of(tmp_path, cpu_blocks=3, disk_blocks=8, admission=admission)
        store.start()
        (read, pr), (unread, pu) = blocks(2, start=500)
        await store.put(read, pr)
        await store.put(unread, pu)
        await store.write_behind.flush()
        disk = store.tiers[1]
        assert (read.key in disk, unread.key in disk) == ((True, True) if admission == "all" else (False, False))
        assert (await get_all(store, [(read, pr)]))[0] is not None
        await store.write_behind.flush()
        assert read.key in disk
        for header, payload in blocks(3, start=510):  # evicts both from the CPU tier
            await store.put(header, payload)
        await store.write_behind.flush()
        assert store.locate(read.key) == 1
        assert store.locate(unread.key) == (1 if admission == "all" else None)
        # counted: each block's Put skipped the disk, and so did the unread block's eviction
        m = store.metrics
        assert m.value(m.not_admitted, tier="disk") == (0 if admission == "all" else 2 + 3 + 1)
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


def test_a_durable_put_is_written_down_whatever_the_admission(tmp_path):
    async def scenario():
        tiers = [CpuTier(3 * BLOCK + 4096), DiskTier(tmp_path, 8 * BLOCK, fsync=True)]
        store = BlockStore(tiers, Metrics(), admission="reused")
        store.start()
        (header, payload), = blocks(1, start=600)
        await store.put(header, payload, durable=True)
        assert header.key in tiers[1]
        await store.close()
    asyncio.run(scenario())


def test_adaptive_keeps_a_reused_set_through_scans_that_prefix_lru_loses(tmp_path):
    """Three chains read again and again between scans of one-off chains that fill the tier: under
    prefix-lru every scan pushes the reused chains out; under adaptive the duel turns to ARC, whose
    frequent segment keeps them."""
    async def scenario(eviction):
        store = store_of(tmp_path / eviction, cpu_blocks=12, eviction=eviction)
        store.start()
        reused = [blocks(2, start=1000 + 10 * i) for i in range(3)]
        hits = 0
        for round_ in range(40):
            for chain in reused:
                keys = [h.key for h, _ in chain]
                found = store.lookup(keys).hits
                hits += found
                await get_all(store, chain[:found])
                await put_chain(store, chain)
            for s in range(3):  # scans: 15 new blocks a round, more than the tier holds
                await put_chain(store, blocks(5, start=20_000 + 100 * round_ + 10 * s))
        store.check_integrity()
        await store.close()
        return hits
    (tmp_path / "prefix-lru").mkdir()
    (tmp_path / "adaptive").mkdir()
    lru_hits, adaptive_hits = asyncio.run(scenario("prefix-lru")), asyncio.run(scenario("adaptive"))
    assert lru_hits == 0
    assert adaptive_hits > 100, adaptive_hits  # of 240: all but the rounds before the duel turns


def test_a_tenants_reads_promote_only_its_own_blocks(tmp_path):
    """ARC promotes a block used again. A tenant's Gets name its own stored keys only (derived from
    its name: tests/test_tenancy.py), so hammering reads moves its blocks into the frequent segment
    and leaves every other tenant's where they were."""
    async def scenario():
        store = store_of(tmp_path, cpu_blocks=20, eviction="adaptive")
        store.start()
        mine, theirs = blocks(4, start=1100), blocks(4, start=1200)
        for header, payload in mine:
            await store.put(header, payload, owner="a")
        for header, payload in theirs:
            await store.put(header, payload, owner="b")
        for _ in range(50):
            await get_all(store, theirs)
        arc = store.residency[0].arc
        assert all(h.key in arc.recent for h, _ in mine)
        assert all(h.key in arc.frequent for h, _ in theirs)
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


def test_adaptive_bounds_what_it_remembers_against_a_flood_of_tiny_blocks():
    """A client storing 50,000 distinct blocks of a few bytes: the shadows keep at most SHADOW_KEYS
    keys, the ghosts at most the tier's keys and GHOST_SLACK more, whatever the blocks' sizes."""
    from kvstore.daemon.adaptive import GHOST_SLACK, MAX_RATE, SHADOW_KEYS, ArcOrder, EvictionDuel

    duel = EvictionDuel(reach=1 << 30)
    arc = ArcOrder(1 << 30)
    held: list[bytes] = []
    for i in range(50_000):
        key = i.to_bytes(16, "little")
        duel.use(key, 1, parent=(i - 1).to_bytes(16, "little") if i else None)
        arc.add(key, 1)
        held.append(key)
        if len(held) > 100:
            arc.remove(held.pop(0))
    assert duel.rate == MAX_RATE  # a gibibyte of 1-byte blocks: the sparsest sample
    assert len(duel._arc.lru) <= SHADOW_KEYS and len(duel._lru.lru) <= SHADOW_KEYS
    assert len(arc.ghost_recent) + len(arc.ghost_frequent) <= len(arc) + GHOST_SLACK
    arc.check_integrity(set(held))


def test_unknown_policies_are_refused_with_their_names(tmp_path):
    with pytest.raises(ValueError, match="eviction must be one of"):
        store_of(tmp_path, 2, eviction="mru")
    with pytest.raises(ValueError, match="admission must be one of"):
        store_of(tmp_path, 2, admission="sometimes")


@pytest.mark.parametrize("eviction, hits", [(None, 5), ("lru", 0), ("adaptive", 5)])
def test_through_the_daemon_the_clients_parents_keep_a_prompts_prefix(daemon_factory, eviction, hits):
    """A real daemon with a CPU tier of six blocks: a client Puts a chain of six with parents (as
    the engines do), then an unrelated block. The default policy keeps the chain's first five (the
    old one, still selectable, none; adaptive, which starts as prefix-lru, five); a parent of the
    wrong length is refused with a one-line reason."""
    import grpc
    import numpy as np

    from engine_adapter.client.kvstore_client import KVStoreClient
    from kvstore.keys import KVLayout, Namespace, prefix_keys

    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16")
    namespace = Namespace("policy-model", layout, chunk_tokens=32)
    block_bytes = layout.block_bytes(32)  # 256 KiB: the CPU tier's 1 MiB least is four
    daemon = daemon_factory(cpu_capacity=6 * block_bytes + 8192, disk_path="",
                            **({"eviction": eviction} if eviction else {}))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1000, 7 * 32).tolist()
    keys = prefix_keys(namespace, tokens)
    payloads = [rng.standard_normal(block_bytes // 2).astype(np.float16) for _ in keys]
    with KVStoreClient(daemon.address) as client:
        client.put(namespace, [(k, 32, p, keys[i - 1] if i else b"") for i, (k, p) in enumerate(zip(keys[:6], payloads))])
        client.put(namespace, [(keys[6][::-1], 32, payloads[6])])  # not part of the chain
        assert client.lookup(keys[:6]).hits == hits
        with pytest.raises(grpc.RpcError) as refused:
            client.put(namespace, [(keys[6], 32, payloads[6], b"short")])
        assert "parent is 5 bytes" in refused.value.details()


def test_a_pipelined_put_is_stored_in_the_batchs_order(daemon_factory, monkeypatch):
    """A client sends a large batch as Puts of a quarter, copying the next while the daemon stores
    one, and sends a Put once the one before is stored: under plain LRU the batch's first block is
    still the oldest, so one more block evicts it and nothing else (with two Puts in the daemon at
    once, a CI run saw the third block evicted)."""
    import numpy as np

    import engine_adapter.client.arena_calls as arena_calls
    from engine_adapter.client.kvstore_client import KVStoreClient
    from kvstore.keys import KVLayout, Namespace, prefix_keys

    monkeypatch.setattr(arena_calls, "PIPELINE_PART_BYTES", 1)  # a quarter of any batch per Put
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16")
    namespace = Namespace("order-model", layout, chunk_tokens=32)
    block_bytes = layout.block_bytes(32)
    rng = np.random.default_rng(5)
    for round_ in range(3):
        daemon = daemon_factory(f"d{round_}", cpu_capacity=8 * block_bytes + 8192, disk_path="", eviction="lru")
        keys = prefix_keys(namespace, rng.integers(0, 1000, 9 * 32).tolist())
        payloads = [rng.standard_normal(block_bytes // 2).astype(np.float16) for _ in keys]
        with KVStoreClient(daemon.address) as client:
            assert client.put(namespace, [(k, 32, p) for k, p in zip(keys[:8], payloads)]) == 8
            client.put(namespace, [(keys[8], 32, payloads[8])])
            assert [client.lookup([k]).hits for k in keys[:8]] == [0] + [1] * 7, f"round {round_}"
        daemon.stop()


MOONCAKE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def _replay_through_store(tmp_path, trace, tier, eviction: str) -> float:
    """Token hit ratio of ``trace`` replayed through a real BlockStore on ``tier`` as the vLLM
    connector calls it: Lookup, a Get of the hit run, a Put of the rest naming each block's parent.
    Each trace block's tokens are the stored block's; its key a hash of the trace's."""
    import hashlib

    from kvstore.block import BlockHeader, payload_checksum
    from tests.test_tiers import LAYOUT

    def key(name: str) -> bytes:
        return hashlib.blake2b(name.encode(), digest_size=16).digest()

    async def replay() -> float:
        store = BlockStore([tier], Metrics(), write_through=False, eviction=eviction)
        store.start()
        hit_tokens = total = 0
        for request in trace:
            keys = [key(b.key) for b in request.blocks]
            hits = store.lookup(keys).hits
            hit_tokens += sum(b.tokens for b in request.blocks[:hits])
            total += request.tokens
            await store.reads.get_many_into([(k, memoryview(bytearray(LAYOUT.block_bytes(b.tokens))))
                                             for k, b in zip(keys[:hits], request.blocks)])
            for i in range(hits, len(keys)):
                payload = bytes(LAYOUT.block_bytes(request.blocks[i].tokens))
                header = BlockHeader(key=keys[i], namespace=b"n" * 16, layout=LAYOUT, tokens=request.blocks[i].tokens,
                                     payload_len=len(payload), checksum=payload_checksum(payload))
                await store.put(header, memoryview(payload), parent=keys[i - 1] if i else b"")
        store.check_integrity()
        await store.close()
        return hit_tokens / total

    return asyncio.run(replay())


def _stored_len(tokens: int) -> int:
    from kvstore.block import BlockHeader
    from tests.test_tiers import LAYOUT
    return BlockHeader(key=b"k" * 16, namespace=b"n" * 16, layout=LAYOUT, tokens=tokens,
                       payload_len=LAYOUT.block_bytes(tokens), checksum=0).block_len


@pytest.mark.parametrize("eviction", ["prefix-lru", "lru", "adaptive"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_the_simulator_predicts_the_daemons_hit_ratio(tmp_path, eviction, fraction):
    """bench/cache_policy.py replays traces against models of the daemon's policies; the docs'
    policy table rests on those models. Here the same synthetic multi-round trace runs through the
    real BlockStore (a CPU tier, Lookup, Get, Put with parents, as the vLLM connector calls them)
    and the two token hit ratios agree within 2 points."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from cache_policy import simulate, working_set_bytes
    from cache_trace import synthetic_trace

    tokens = 16
    block_len = _stored_len(tokens)
    trace = synthetic_trace(users=24, rounds=4, context_blocks=8, question_blocks=1, seed=5,
                            block_tokens=tokens, token_bytes=block_len // tokens)
    distinct = working_set_bytes(trace) // (block_len // tokens * tokens)
    capacity_blocks = int(distinct * fraction)
    rounded = (block_len + 63) // 64 * 64  # the CPU arena's extents
    daemon = _replay_through_store(tmp_path, trace, CpuTier(capacity_blocks * rounded + 32), eviction)
    simulated = simulate(trace, eviction, capacity_blocks * (block_len // tokens * tokens)).hit_ratio
    print(f"{eviction} at {fraction:.0%}: daemon {daemon:.4f}, simulator {simulated:.4f}")
    assert abs(daemon - simulated) <= 0.02, (daemon, simulated)


def mooncake_slice(one_in: int) -> list:
    """The Mooncake conversation trace's conversations whose second block's id is a multiple of
    ``one_in`` (a conversation's turns share it: a sample of whole conversations over the hour, as
    a short window of it would not be: turns come back minutes apart), from ../shared beside the
    clone (CI has it), or where it is absent a generated trace of a like shape (one-off chains
    behind a shared first block, conversations that come back). Blocks of 16 tokens for its 512, a
    tail block of its share of them, each block's bytes what the daemon stores for it."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from cache_trace import Block, Request, load_trace, synthetic_trace

    if MOONCAKE.exists():
        raw = [r for r in load_trace(MOONCAKE, token_bytes=1)
               if len(r.blocks) > 1 and int(r.blocks[1].key.removeprefix("m")) % one_in == 0]
    else:
        raw = synthetic_trace(users=40, rounds=3, context_blocks=16, question_blocks=1, seed=3,
                              shared_system_blocks=1, scans=0.3, block_tokens=512, token_bytes=1)
    trace = []
    for request in raw:
        blocks = []
        for block in request.blocks:
            tokens = max(1, -(-block.tokens * 16 // 512))
            blocks.append(Block(block.key, block.parent, tokens, _stored_len(tokens)))
        trace.append(Request(request.request, tuple(blocks)))
    return trace


@pytest.mark.parametrize("eviction", ["prefix-lru", "adaptive"])
@pytest.mark.parametrize("fraction", [0.1, 0.25])
def test_the_simulator_predicts_the_daemon_on_a_production_trace(tmp_path, eviction, fraction):
    """The same on a slice of the Mooncake conversation trace (docs/policy.md; 342 requests, 8,449
    block reads), blocks of the real trace's lengths (a tail block shorter), through a tier that
    counts bytes as the simulator does (disk: a CPU arena's extents would add fragmentation)."""
    trace = mooncake_slice(40)  # (puts bench/ on sys.path)
    from cache_policy import simulate, working_set_bytes

    capacity = int(working_set_bytes(trace) * fraction)
    daemon = _replay_through_store(tmp_path, trace, DiskTier(tmp_path, capacity, fsync=False), eviction)
    simulated = simulate(trace, eviction, capacity).hit_ratio
    print(f"{eviction} at {fraction:.0%}: daemon {daemon:.4f}, simulator {simulated:.4f}")
    assert simulated > 0.05  # the slice reuses blocks at this size: the comparison says something
    assert abs(daemon - simulated) <= 0.02, (daemon, simulated)
