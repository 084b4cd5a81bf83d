"""The GPU tier's logic on device "cpu" (CI), and for real on CUDA (marked, skipped without it)."""

import asyncio

import pytest
import torch

from kvstore.daemon.metrics import Metrics
from kvstore.daemon.placement import BlockStore
from tests.test_tiers import fill, make_block
from tiers.cpu import CpuTier
from tiers.gpu import GpuTier

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_full_and_integrity(device):
    blocks = [make_block(i, tokens=40) for i in range(5)]
    tier = GpuTier(3 * blocks[0][0].payload_len + 1024, device=device)
    stored = fill(tier, blocks)
    assert len(stored) == 3
    tier.check_integrity()
    for header, payload in stored:
        dest = bytearray(header.payload_len)
        assert tier.read_payload_into(header.key, memoryview(dest)) == header
        assert bytes(dest) == bytes(payload)
        assert tier.payload_tensor(header.key).device.type == device
    tier.delete(stored[1][0].key)
    tier.check_integrity()
    tier.put(*blocks[4])  # fits in the freed extent
    tier.check_integrity()


def test_batched_reads_copy_once_per_contiguous_run():
    blocks = [make_block(i, tokens=32) for i in range(4)]
    size = blocks[0][0].payload_len
    tier = GpuTier(8 * size, device="cpu")
    for header, payload in blocks:
        tier.put(header, payload)
    slab = torch.empty(4 * size, dtype=torch.uint8)  # one host slab: destinations adjacent
    copies = []
    original = tier._copy
    tier._copy = lambda dst, src: (copies.append(dst.numel()), original(dst, src))
    headers = tier.read_many_into([(h.key, slab[i * size:(i + 1) * size]) for i, (h, _) in enumerate(blocks)])
    assert size % 256 == 0 and copies == [4 * size]  # one copy for four pool-adjacent blocks
    for i, (header, payload) in enumerate(blocks):
        assert headers[i] == header
        assert bytes(slab[i * size:(i + 1) * size].numpy()) == bytes(payload)


def test_placement_with_a_gpu_tier_on_top_demotes_and_promotes():
    async def scenario():
        b0 = make_block(100)[0]
        gpu = GpuTier(2 * b0.payload_len + 512, device="cpu")
        cpu = CpuTier(10 * b0.block_len)
        store = BlockStore([gpu, cpu], Metrics(), write_through=False)
        store.start()
        blocks = [make_block(100 + i) for i in range(4)]
        for header, payload in blocks:
            await store.put(header, payload)
        assert [store.locate(h.key) for h, _ in blocks] == [1, 1, 0, 0]
        dest = memoryview(bytearray(b0.payload_len))
        result = await store.reads.get_into(blocks[0][0].key, dest)
        assert result.tier == "cpu" and bytes(dest) == bytes(blocks[0][1])
        await asyncio.gather(*store.promoter.tasks)
        assert store.locate(blocks[0][0].key) == 0
        store.check_integrity()
        await store.close()
    asyncio.run(scenario())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_handle_maps_in_another_process():
    import torch.multiprocessing as mp

    header, payload = make_block(7)
    tier = GpuTier(2 * header.payload_len, device="cuda")
    tier.put(header, payload)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_sum, args=(tier.payload_tensor(header.key), queue))
    proc.start()
    total = queue.get(timeout=60)
    proc.join(60)
    assert total == int(torch.frombuffer(payload, dtype=torch.uint8).sum())


def _child_sum(tensor, queue):
    queue.put(int(tensor.sum()))


def test_batched_reads_into_one_arena_copy_once():
    import mmap

    blocks = [make_block(200 + i, tokens=32) for i in range(3)]
    size = blocks[0][0].payload_len
    tier = GpuTier(8 * size, device="cpu")
    for header, payload in blocks:
        tier.put(header, payload)
    arena = memoryview(mmap.mmap(-1, 4 * size))
    copies = []
    original = tier._copy
    tier._copy = lambda dst, src: (copies.append(dst.numel()), original(dst, src))
    # Blocks 0 and 1 land next to each other in the arena; block 2 goes after a gap.
    dests = [arena[0:size], arena[size:2 * size], arena[3 * size:4 * size]]
    tier.read_many_into([(h.key, d) for (h, _), d in zip(blocks, dests)])
    assert copies == [2 * size, size]
    for (header, payload), dest in zip(blocks, dests):
        assert bytes(dest) == bytes(payload)


def test_daemon_with_a_gpu_tier_on_device_cpu(daemon_factory):
    from engine_adapter.client.kvstore_client import KVStoreClient
    from tests.test_daemon import BLOCK, NS, make_blocks

    d = daemon_factory(gpu_capacity="1MiB", gpu_device="cpu", cpu_capacity="2MiB", write_policy="write-back")
    keys, payloads = make_blocks(20, seed=40)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        tiers = client.lookup(keys).tiers
        assert tiers[-1] == "gpu" and "cpu" in tiers and "disk" in tiers
        assert client.get(keys, BLOCK) == [p.tobytes() for p in payloads]
        assert set(client.stats()["tiers"]) == {"gpu", "cpu", "disk"}


@pytest.mark.parametrize("top", ["gpu", "cpu"])
def test_layerwise_get_delivers_every_layer_in_order(daemon_factory, top):
    from engine_adapter.client.kvstore_client import KVStoreClient
    from tests.test_daemon import BLOCK, LAYOUT, NS, make_blocks

    settings = dict(gpu_capacity="4MiB", gpu_device="cpu") if top == "gpu" else {}
    d = daemon_factory(cpu_capacity="2MiB", write_policy="write-back", promote_on_get="false", **settings)
    keys, payloads = make_blocks(24, seed=41)  # more than the memory tiers: some come from disk
    layer_bytes = BLOCK // LAYOUT.num_layers
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        tiers = client.lookup(keys).tiers
        assert "disk" in tiers and top in tiers
        with client.fetch_layers(keys + [b"\x01" * 16], BLOCK) as stream:
            assert stream.blocks[-1] is None
            assert [b.tier for b in stream.blocks[:-1]] == list(tiers)
            seen = []
            for layer in stream:
                seen.append(layer)
                for block, payload in zip(stream.blocks, payloads):  # this layer is in place now
                    start = layer * layer_bytes
                    assert bytes(block.payload[start:start + layer_bytes]) == payload.tobytes()[start:start + layer_bytes]
            assert seen == list(range(LAYOUT.num_layers))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_data_plane_maps_the_daemon_pool_and_copies_device_to_device(daemon_factory):
    from engine_adapter.client.kvstore_client import KVStoreClient
    from tests.test_daemon import NS, make_blocks

    d = daemon_factory(gpu_capacity="64MiB", gpu_device="cuda")
    keys, payloads = make_blocks(4, seed=42)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        with client.fetch_gpu(keys + [b"\x02" * 16]) as views:
            assert views[-1] is None
            for view, payload in zip(views, payloads):
                copy = torch.empty_like(view)
                copy.copy_(view)  # device to device
                assert bytes(copy.cpu().numpy()) == payload.tobytes()
