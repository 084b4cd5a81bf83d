"""The GPU tier's logic on device "cpu" (CI), and for real on CUDA (marked, skipped without it)."""

import asyncio

import pytest
import torch

from kvstore.metrics import Metrics
from kvstore.placement import BlockStore
from tests.test_tiers import make_block
from tiers.base import TierFullError
from tiers.cpu import CpuTier
from tiers.gpu import GpuTier

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_full_and_integrity(device):
    blocks = [make_block(i, tokens=40) for i in range(5)]
    tier = GpuTier(3 * blocks[0][0].payload_len + 1024, device=device)
    stored = []
    for header, payload in blocks:
        try:
            tier.put(header, payload)
            stored.append((header, payload))
        except TierFullError:
            break
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
        result = await store.get_into(blocks[0][0].key, dest)
        assert result.tier == "cpu" and bytes(dest) == bytes(blocks[0][1])
        await asyncio.gather(*store._background)
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
