"""kvtc@auto: the daemon calibrates each namespace from its first blocks, without the model.

The blind calibration (compression/blind.py) on synthetic RoPE keys with a known theta and on the
real model's KV (theta and every block's start recovered), and a real daemon process with
``disk_codec = kvtc@auto``: first blocks kept as they are, later ones coded, the calibration kept
across a restart and fetched by an engine elsewhere, tenants' calibrations apart, and hostile first
blocks unable to make later blocks lossy beyond the daemon's check.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
import torch

from compression import calibration_store
from compression.blind import BlindCalibration, fit_theta, groups_for, rope_freq
from compression.calibration import Allocation
from compression.calibration_fit import calibrate
from compression.transform import TransformCodec, estimate_start
from kernels.rope_ref import rerotate_keys
from kvstore.daemon.autocal import AUTO_ALLOCATION
from kvstore.daemon.autocal_bounds import MAX_RELATIVE_ERROR, MAX_TOKEN_ERROR, relative_errors
from kvstore.keys import KVLayout, Namespace

LAYERS, HEADS, HEAD_DIM, THETA = 3, 2, 32, 50000.0


def rope_keys_block(tokens: int, start: int, seed: int, theta: float = THETA, rotate: bool = True) -> torch.Tensor:
    """[L, 2, H, T, D] float32: keys with a clear mean and low-rank variation, turned by standard RoPE
    to positions start..start+T-1 (``rotate``); values correlated noise. Irregular, never zero."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(7)  # the "model": one mean and one mixing for every block
    mean = 3.0 * torch.randn(LAYERS, HEADS, HEAD_DIM, generator=shared)
    mix = torch.randn(LAYERS, 2, 6, HEADS * HEAD_DIM, generator=shared)
    x = torch.randn(LAYERS, 2, tokens, 6, generator=g) @ mix + 0.2 * torch.randn(LAYERS, 2, tokens, HEADS * HEAD_DIM,
                                                                                  generator=g)
    x = x.view(LAYERS, 2, tokens, HEADS, HEAD_DIM).permute(0, 1, 3, 2, 4).contiguous()
    x[:, 0] += mean[:, :, None, :]
    if rotate:
        positions = torch.arange(start, start + tokens)
        x[:, 0] = rerotate_keys(x[:, 0].contiguous(), torch.zeros_like(positions), positions,
                                rope_freq(theta, HEAD_DIM))
    return x


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration_store.CALIBRATION_DIR_ENV, str(tmp_path / "calibrations"))


def test_groups_keep_rows_within_the_channel_cap():
    assert groups_for(3, 64) == 1  # SmolLM2: 192 channels, one basis per layer and K/V
    assert groups_for(8, 128) == 4  # Llama-3-8B: two heads a row, 256 channels
    assert groups_for(5, 64) == 5 and groups_for(1, 512) == 1  # no divisor fits: one head a row


def test_theta_and_starts_recovered_from_blocks_alone():
    starts = [0, 256, 512, 768, 1024, 1280, 4000, 9000]
    order = [1, 0, 3, 2] + [4, 7, 5, 6]  # the warm-up holds the first chunk, not first
    blind = BlindCalibration(LAYERS, HEADS, HEAD_DIM)
    for i in order:
        blind.add(rope_keys_block(256 if starts[i] < 4000 else 200, starts[i], seed=i))
    assert blind.theta is not None and abs(blind.theta / THETA - 1) < 0.01, blind.theta
    assert blind.starts == [starts[i] for i in order]
    calibration = blind.calibration(Allocation(0.2, 0.2))
    assert calibration.allocation.sink_tokens == 4 and calibration.rope_inv_freq is not None
    assert "RoPE theta" in calibration.source and "no model" in calibration.source
    # the codec finds a new block's start against this calibration, and decodes within its bound
    block = rope_keys_block(256, 2304, seed=20).to(torch.float16)
    assert estimate_start(block[:, 0].float(), calibration) == 2304
    codec = TransformCodec(calibration)
    encoded = codec.encode(block)
    decoded = codec.decode(encoded.payload, encoded.params, tuple(block.shape), block.dtype)
    assert (decoded.double() - block.double()).abs().max() <= codec.error_bound(block)
    assert float(relative_errors(block, decoded)[0].max()) < 0.2


def test_no_rope_frame_when_no_theta_explains_the_keys():
    """Keys never turned (or by another form of RoPE): plain PCA of the blocks as they are (format v2)."""
    blocks = [rope_keys_block(256, 256 * i, seed=i, rotate=False) for i in range(5)]
    theta, fitted, unturned = fit_theta([b[:, 0] for b in blocks[:4]])
    assert theta is None and fitted <= 1.05 * unturned
    blind = BlindCalibration(LAYERS, HEADS, HEAD_DIM)
    for block in blocks:
        blind.add(block)
    calibration = blind.calibration(Allocation(0.2, 0.2))
    assert calibration.rope_inv_freq is None and calibration.allocation.sink_tokens == 0
    assert "post-RoPE" in calibration.source


def test_blind_calibration_on_the_real_model():
    """SmolLM2's own KV, 256-token chunks in the order an engine stores them: theta 100000 found
    to 1%, every chunk's start found, keys coded before RoPE with lower error than post-RoPE."""
    from engine_adapter.reference.generate import prefill
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf

    model, tokenizer = load_gguf(find_smollm2_gguf(), dtype=torch.float32)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} valve of pump {i * 7 % 13} "
                    f"was inspected on day {i % 30 + 1} and found {['sound', 'worn', 'leaking'][i % 3]}."
                    for i in range(120))
    ids = tokenizer.encode(text)[:1536]
    kv = model.new_cache(len(ids))
    with torch.inference_mode():
        prefill(model, ids, kv, start_pos=0)
    context = kv.export(0, len(ids)).to(torch.float16)
    chunks = [(s, context[:, :, :, s:s + 256].contiguous()) for s in range(0, len(ids) - 255, 256)]
    cfg = model.config
    blind = BlindCalibration(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    for _, chunk in chunks:
        blind.add(chunk)
    assert abs(blind.theta / cfg.rope_theta - 1) < 0.01, (blind.theta, cfg.rope_theta)
    assert blind.starts == [s for s, _ in chunks]
    pre = TransformCodec(blind.calibration(AUTO_ALLOCATION))
    post = TransformCodec(calibrate([chunk for _, chunk in chunks], AUTO_ALLOCATION))  # keys as stored
    errors = {}
    for name, codec in (("pre", pre), ("post", post)):
        encoded = codec.encode(chunks[2][1])
        decoded = codec.decode(encoded.payload, encoded.params, tuple(chunks[2][1].shape), torch.float16)
        key_err = relative_errors(chunks[2][1], decoded)[0][:, 0].mean()
        errors[name] = (len(encoded.payload), float(key_err))
    # keys before RoPE: fewer bytes at no more key error (a per-block figure; the model-level
    # measurement is bench/codec_quality.py, docs/compression.md)
    assert errors["pre"][0] < errors["post"][0] and errors["pre"][1] <= errors["post"][1] * 1.1, errors


# -- a real daemon with disk_codec = kvtc@auto -----------------------------------------------------------

AUTO_LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float16")
AUTO_NS = Namespace("autocal-test-model", AUTO_LAYOUT, chunk_tokens=256)
BLOCK_BYTES = AUTO_LAYOUT.block_bytes(256)


def prefix_blocks(n: int, seed: int, ns: Namespace = AUTO_NS, first_start: int = 0):
    """``n`` keys of one prompt and their blocks (float16 numpy), chunk i at positions 256 i.."""
    from kvstore.keys import prefix_keys

    tokens = np.random.default_rng(seed).integers(0, 50000, size=n * 256)
    keys = prefix_keys(ns, tokens)
    blocks = [rope_keys_block(256, first_start + 256 * i, seed=seed * 100 + i).to(torch.float16).numpy()
              for i in range(n)]
    return keys, blocks


def on_disk(client, keys: list[bytes]) -> list:
    """The blocks as the disk tier holds them: the CPU tier cleared first (promotion is off)."""
    from engine_adapter.client.prefix_cache import fetch_slot_bytes

    client.clear(["cpu"])
    with client.fetch(keys, fetch_slot_bytes(AUTO_LAYOUT, 256)) as fetched:
        return [(b.tier, b.codec, dict(b.codec_params), bytes(b.payload)) for b in fetched]


def wait_for(predicate, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def published(client, short_tmp) -> bool:
    """The daemon has made a calibration this client's tenant can fetch from the cache (only then
    does it code that namespace's blocks)."""
    return any(client.lookup([calibration_store.calibration_key(p.read_text().strip())]).hits
               for p in (short_tmp / "calibrations" / "auto").glob("*"))


def auto_daemon(daemon_factory, short_tmp, name: str = "d0", **settings):
    settings = {"disk_codec": "kvtc@auto", "auto_calibration_tokens": "1024", "promote_on_get": "false",
                "calibration_dir": str(short_tmp / "calibrations"), "log_level": "INFO", **settings}
    return daemon_factory(name, **settings)


def test_daemon_calibrates_a_namespace_from_its_first_blocks(daemon_factory, short_tmp, tmp_path, monkeypatch):
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.client.prefix_cache import PrefixCache, fetched_tensor

    d = auto_daemon(daemon_factory, short_tmp)
    keys, blocks = prefix_blocks(10, seed=1)
    with KVStoreClient(d.address) as client:
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[:4], blocks[:4])])  # the sample: 1024 tokens
        wait_for(lambda: published(client, short_tmp))
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[4:], blocks[4:])])
        wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] >= 11)  # 10 blocks and the calibration
        stored = on_disk(client, keys)
    pointer = next((short_tmp / "calibrations" / "auto").glob("*"))
    calibration_id = pointer.read_text().strip()
    assert (short_tmp / "calibrations" / f"{calibration_id}.kvcal").is_file()
    for i, (tier, codec, params, payload) in enumerate(stored):
        assert tier == "disk"
        if i < 4:  # sampled: stored as they came
            assert codec == "raw" and payload == blocks[i].tobytes()
        else:  # coded with the namespace's calibration, 3-6x smaller here
            assert codec == f"kvtc@{calibration_id[:12]}" and params["calibration"] == calibration_id
            assert params["start"] == 256 * i and len(payload) < BLOCK_BYTES / 3
    assert "calibrated namespace" in d.log.read_text()

    # an engine on another host (no calibration files) decodes them through its daemon
    monkeypatch.setenv(calibration_store.CALIBRATION_DIR_ENV, str(tmp_path / "elsewhere"))
    calibration_store._loaded.pop(calibration_id, None)
    with KVStoreClient(d.address) as client:
        cache = PrefixCache(client, AUTO_NS)
        try:
            with client.fetch(keys[4:], BLOCK_BYTES + 4096) as fetched:
                for block, original in zip(fetched, blocks[4:]):
                    decoded = fetched_tensor(block)
                    total, per_token = relative_errors(torch.from_numpy(original), decoded)
                    assert float(total.max()) <= MAX_RELATIVE_ERROR and float(per_token.max()) <= MAX_TOKEN_ERROR
        finally:
            cache.close()
    assert calibration_id in calibration_store._loaded

    # a restart keeps the namespace's calibration (stored in the cache again): new blocks are coded with it
    d.stop()
    d2 = auto_daemon(daemon_factory, short_tmp, "d1")
    more_keys, more = prefix_blocks(2, seed=2, first_start=0)
    first_key, first = prefix_blocks(1, seed=3)
    with KVStoreClient(d2.address) as client:
        client.put(AUTO_NS, [(first_key[0], 256, first[0])])  # stored as it came while the calibration is re-stored
        wait_for(lambda: published(client, short_tmp))
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(more_keys, more)])
        wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] >= 4)  # 3 blocks and the calibration
        stored = on_disk(client, more_keys)
    assert [codec for _, codec, _, _ in stored] == [f"kvtc@{calibration_id[:12]}"] * 2
    assert stored[0][2]["sink_tokens"] == 4  # a prompt's first block: its sink positions raw
    assert len(list((short_tmp / "calibrations" / "auto").glob("*"))) == 1


def test_tenants_get_calibrations_of_their_own(daemon_factory, short_tmp):
    """The same client namespace under two tenants: two calibrations, each made from that tenant's
    blocks only, coding only that tenant's blocks, stored where that tenant (and no other) can fetch it."""
    from engine_adapter.client.kvstore_client import KVStoreClient
    from kvstore.daemon.auth import Tenant, tenant_key
    from kvstore.host import load_secret
    from kvstore.block import parse_block

    tenants = short_tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n\n'
                       '[[tenant]]\nname = "b"\ntoken = "token-b-0123456789"\n')
    d = auto_daemon(daemon_factory, short_tmp, tenants_file=str(tenants))
    for name, seed in (("a", 3), ("b", 4)):
        keys, blocks = prefix_blocks(6, seed=seed)
        with KVStoreClient(d.address, token=f"token-{name}-0123456789") as client:
            client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[:4], blocks[:4])])
            wait_for(lambda: published(client, short_tmp))
            client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[4:], blocks[4:])])
    secret = load_secret(d.folder.parent / "tenant-secret")
    stored_ns = {name: Tenant(name, key=tenant_key(secret, name)).stored_key(AUTO_NS.id) for name in "ab"}
    ids = {name: (short_tmp / "calibrations" / "auto" / f"{ns.hex()}-{AUTO_LAYOUT.num_layers}x{HEADS}x{HEAD_DIM}-"
                  f"float16").read_text().strip() for name, ns in stored_ns.items()}
    assert ids["a"] != ids["b"]
    # on disk, each tenant's later blocks name that tenant's calibration
    wait_for(lambda: sum(1 for _ in (d.folder / "disk").rglob("*.kvb")) >= 14)  # 12 blocks, 2 calibrations
    coded = {}
    for path in (d.folder / "disk").rglob("*.kvb"):
        header, _ = parse_block(path.read_bytes())
        if header.codec.startswith("kvtc"):
            coded.setdefault(header.namespace, set()).add(header.codec_params["calibration"])
    assert coded == {stored_ns["a"]: {ids["a"]}, stored_ns["b"]: {ids["b"]}}
    for name, other in (("a", "b"), ("b", "a")):
        with KVStoreClient(d.address, token=f"token-{name}-0123456789") as client:
            own, theirs = client.get([calibration_store.calibration_key(ids[t]) for t in (name, other)], 64 << 20,
                                     inline=True)
        assert own is not None and theirs is None


def test_hostile_first_blocks_cannot_make_later_blocks_lossy(daemon_factory, short_tmp):
    """A client's first blocks shape its namespace's calibration. Blocks unlike the rest (here 1e4
    times larger, no RoPE structure) make one that codes the normal blocks badly: the daemon's check
    stores those as they are. A non-finite block is never sampled, and is stored bit for bit."""
    from engine_adapter.client.kvstore_client import KVStoreClient

    d = auto_daemon(daemon_factory, short_tmp)
    keys, normal = prefix_blocks(9, seed=5)
    rng = np.random.default_rng(9)
    hostile = [(rng.standard_normal(normal[0].shape) * 1e4).astype(np.float16) for _ in range(4)]
    nan_block = normal[4].copy()
    nan_block.reshape(-1)[::97] = np.nan
    first = hostile[:2] + [nan_block] + hostile[2:]
    with KVStoreClient(d.address) as client:
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[:5], first)])
        wait_for(lambda: published(client, short_tmp))
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[5:], normal[5:])])
        wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] >= 10)
        stored = on_disk(client, keys)
    for (_, codec, _, payload), original in zip(stored, first + normal[5:]):
        assert codec == "raw" and payload == original.tobytes()


def test_config_takes_kvtc_auto_and_says_what_is_wrong():
    from kvstore.daemon.config import DaemonConfig

    config = DaemonConfig(disk_codec="kvtc@auto", s3_codec="raw", auto_calibration_tokens=4096)
    assert config.disk_codec == "kvtc@auto"
    with pytest.raises(ValueError, match="auto_calibration_tokens must be in 512..1048576, got 10"):
        DaemonConfig(disk_codec="kvtc@auto", auto_calibration_tokens=10)
    with pytest.raises(ValueError, match="lower-case hex"):  # any other kvtc@ still names a calibration id
        DaemonConfig(disk_codec="kvtc@autox")


def test_another_host_sharing_the_bucket_decodes_auto_coded_blocks(daemon_factory, short_tmp, tmp_path,
                                                                   monkeypatch, moto_server, s3_bucket):
    """Host A codes for disk and S3 with kvtc@auto: one calibration, from 4 distinct blocks (each passes
    the calibrator twice, on its way to disk and then to S3). Host B shares only the bucket: an engine
    of B's decodes A's coded blocks, the calibration coming from S3 through B."""
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.client.prefix_cache import PrefixCache, fetched_tensor

    s3 = {"s3_endpoint": moto_server.url, "s3_bucket": s3_bucket}
    a = auto_daemon(daemon_factory, short_tmp, "a", s3_codec="kvtc@auto", **s3)
    keys, blocks = prefix_blocks(7, seed=6)
    with KVStoreClient(a.address) as client:
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[:4], blocks[:4])])
        wait_for(lambda: published(client, short_tmp))
        # The calibration's Put is durable (S3 here): the daemon codes blocks once it returned, which
        # is after the calibration shows in a Lookup; wait for the sample and it to be in S3.
        wait_for(lambda: client.stats()["tiers"]["s3"]["blocks"] >= 5)
        time.sleep(0.2)
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[4:], blocks[4:])])
        wait_for(lambda: client.stats()["tiers"]["s3"]["blocks"] >= 8)  # 7 blocks and the calibration
    assert a.log.read_text().count("calibrated namespace") == 1 and "from 4 blocks" in a.log.read_text()
    b = daemon_factory("b", calibration_dir=str(tmp_path / "b-calibrations"), promote_on_get="false", **s3)
    monkeypatch.setenv(calibration_store.CALIBRATION_DIR_ENV, str(tmp_path / "engine-b"))
    calibration_store._loaded.clear()
    with KVStoreClient(b.address) as client:
        cache = PrefixCache(client, AUTO_NS)
        try:
            wait_for(lambda: client.lookup(keys).hits == 7, timeout=10)
            with client.fetch(keys[4:], BLOCK_BYTES + 4096) as fetched:
                assert {block.tier for block in fetched} == {"s3"}
                assert {block.codec.split("@")[0] for block in fetched} == {"kvtc"}
                for block, original in zip(fetched, blocks[4:]):
                    total, per_token = relative_errors(torch.from_numpy(original), fetched_tensor(block))
                    assert float(total.max()) <= MAX_RELATIVE_ERROR and float(per_token.max()) <= MAX_TOKEN_ERROR
        finally:
            cache.close()


def test_sampling_slots_and_namespaces_are_bounded_per_tenant(tmp_path, monkeypatch):
    """A client making up namespaces holds at most its tenant's share of sampling slots and followed
    namespaces; a sample left idle gives its slot to a namespace that waits, within that namespace's
    tenant's share."""
    import dataclasses

    import kvstore.daemon.autocal as autocal

    calibrator = autocal.AutoCalibrator(sample_tokens=4096, folder=tmp_path)
    monkeypatch.setattr(calibrator, "_submit", lambda job: True)  # the sampler thread is not under test here
    tenant = dataclasses.make_dataclass("T", ["name"])
    namespaces = [bytes([n + 1]) * 16 for n in range(6)]
    owners = ["a", "a", "a", "b", "b", "c"]
    for namespace, owner in zip(namespaces, owners):
        calibrator.note(namespace, tenant(owner))

    def move_down(n: int) -> None:
        header = auto_header(namespaces[n], n)
        out, _ = calibrator.transcode(header, PAYLOAD)
        assert out is header  # while sampling, blocks go down as they came

    def sampling() -> set[int]:
        return {namespaces.index(ns) for (ns, _), s in calibrator._namespaces.items() if s.reserved}

    for n in range(6):
        move_down(n)
    assert sampling() == {0, 1, 3, 4}  # 2 slots a tenant, 4 in all: a's third and c's first wait
    monkeypatch.setattr(autocal, "SAMPLE_IDLE_S", 0.0)
    move_down(2)  # a is at its share: only a's own idle sample can make room
    assert sampling() == {1, 2, 3, 4}
    move_down(5)  # c is under its share and all 4 are taken: the longest idle (a's 1 here) makes room
    assert sampling() == {2, 3, 4, 5}
    monkeypatch.setattr(autocal, "SAMPLE_IDLE_S", 300.0)
    monkeypatch.setattr(autocal, "MAX_NAMESPACES_PER_TENANT", 3)
    other = bytes([9]) * 16
    calibrator.note(other, tenant("a"))
    assert calibrator._state(other, AUTO_LAYOUT) is None  # tenant a follows 3 namespaces already
    monkeypatch.setattr(autocal, "SAMPLE_IDLE_S", 0.0)
    assert calibrator._state(other, AUTO_LAYOUT) is not None  # ... until one without a calibration sat idle
    assert (namespaces[0], AUTO_LAYOUT) not in calibrator._namespaces  # (a's, whose slot went to 2 above)
    monkeypatch.setattr(autocal, "SAMPLE_IDLE_S", 300.0)
    calibrator.note(bytes([10]) * 16, tenant("d"))
    assert calibrator._state(bytes([10]) * 16, AUTO_LAYOUT) is not None  # another tenant's still fits
    assert calibrator._state(bytes([11]) * 16, AUTO_LAYOUT) is None  # no Put of it noted: no tenant to store under
    for n in range(12, 17):  # an open daemon's one anonymous tenant is bound by the totals only
        calibrator.note(bytes([n]) * 16, tenant(""))
        assert calibrator._state(bytes([n]) * 16, AUTO_LAYOUT) is not None


PAYLOAD = rope_keys_block(256, 0, seed=1).to(torch.float16).numpy().tobytes()


def auto_header(namespace: bytes, n: int, layout: KVLayout = AUTO_LAYOUT, tokens: int = 256,
                payload: bytes = PAYLOAD, codec: str = "raw"):
    from kvstore.block import BlockHeader, payload_checksum

    return BlockHeader(key=bytes([n + 1]) * 16, namespace=namespace, layout=layout, tokens=tokens,
                       payload_len=len(payload), checksum=payload_checksum(payload), codec=codec, codec_params={})


def test_daemon_groups_layers_when_told(daemon_factory, short_tmp):
    """auto_layer_group: the daemon's calibration has rows over that many layers (format v4), and the
    blocks it codes with it pass the same per-block checks."""
    from compression.calibration import Calibration
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.client.prefix_cache import PrefixCache, fetched_tensor

    d = auto_daemon(daemon_factory, short_tmp, auto_layer_group="3")
    keys, blocks = prefix_blocks(8, seed=4)
    with KVStoreClient(d.address) as client:
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[:4], blocks[:4])])
        wait_for(lambda: published(client, short_tmp))
        client.put(AUTO_NS, [(k, 256, b) for k, b in zip(keys[4:], blocks[4:])])
        wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] >= 9)
        client.clear(["cpu"])
        cache = PrefixCache(client, AUTO_NS)  # the calibration comes from the daemon
        try:
            with client.fetch(keys[4:], BLOCK_BYTES + 4096) as fetched:
                for block, original in zip(fetched, blocks[4:]):
                    assert block.codec.startswith("kvtc@") and block.tier == "disk"
                    total, per_token = relative_errors(torch.from_numpy(original), fetched_tensor(block))
                    assert float(total.max()) <= MAX_RELATIVE_ERROR and float(per_token.max()) <= MAX_TOKEN_ERROR
        finally:
            cache.close()
    calibration_id = next((short_tmp / "calibrations" / "auto").glob("*")).read_text().strip()
    calibration = Calibration.from_bytes((short_tmp / "calibrations" / f"{calibration_id}.kvcal").read_bytes())
    assert calibration.layer_group == 3 and calibration.rows == 2


def test_grouped_samples_wait_for_enough_tokens_and_a_changed_group_calibrates_again(tmp_path):
    """Rows over layers need twice their channels in tokens (sinks left out): the sample says when
    it is short. A calibration made with another auto_layer_group is not taken up after a restart."""
    from kvstore.daemon.autocal import AutoCalibrator

    blind = BlindCalibration(LAYERS, HEADS, HEAD_DIM, layer_group=3)  # rows of 192 channels: 384 tokens
    for i in range(7):
        blind.add(rope_keys_block(64, 64 * i, seed=60 + i))
        assert blind.short == (3 <= i <= 5)  # (no statistics before the 4th block; 252, 316, 380, 444 tokens)
    calibration = blind.calibration(AUTO_ALLOCATION)
    assert calibration.layer_group == 3

    calibrator = AutoCalibrator(sample_tokens=1024, folder=tmp_path)
    calibrator._keep(calibration, b"n" * 16, AUTO_LAYOUT)
    assert calibrator._recorded(b"n" * 16, AUTO_LAYOUT, layer_group=3).id == calibration.id
    assert calibrator._recorded(b"n" * 16, AUTO_LAYOUT, layer_group=1) is None


def test_layer_group_for_fits_each_layout():
    from kvstore.daemon.autocal_bounds import calibration_bytes, layer_group_for

    smollm2, llama3 = KVLayout(30, 3, 64, "bfloat16"), KVLayout(32, 8, 128, "bfloat16")
    assert layer_group_for(smollm2, 1) == 1 and layer_group_for(smollm2, 5) == 5
    assert calibration_bytes(smollm2, 5) == 5 * calibration_bytes(smollm2)  # 84 MiB
    assert layer_group_for(smollm2, 10) == 6  # 10 layers a row would make a 169 MiB calibration
    assert layer_group_for(smollm2, 10, limit=1 << 30) == 10
    assert layer_group_for(smollm2, 5, sample_tokens=1024) == 2  # statistics need twice the row's channels
    assert layer_group_for(smollm2, 4) == 3  # a divisor of the 30 layers
    assert layer_group_for(llama3, 8) == 1  # its per-layer calibration is already 128 MiB
    assert layer_group_for(KVLayout(4, 1, 1024, "float16"), 4, limit=1 << 40) == 2  # rows of 2,048 channels at most


def test_layouts_too_large_to_calibrate_and_decompression_bombs_are_stored_as_they_came(tmp_path):
    """A client declares the layout: one whose statistics or calibration would take gigabytes, an odd
    head_dim, or a small coded payload that would decode to 256 MiB, is never read by the calibrator."""
    import dataclasses

    import zstandard

    from compression import get_codec
    from kvstore.daemon.autocal import AutoCalibrator
    from kvstore.daemon.autocal_bounds import unfit_layout

    assert unfit_layout(KVLayout(1, 1, 4096, "float16")).startswith("rows of 4096 channels")
    assert "MiB" in unfit_layout(KVLayout(1024, 64, 128, "float16"))
    assert "odd" in unfit_layout(KVLayout(2, 2, 33, "float16"))
    assert unfit_layout(KVLayout(32, 8, 128, "bfloat16")) == ""  # Llama-3-8B: 4 groups of 2 heads, 128 MiB
    assert unfit_layout(AUTO_LAYOUT) == ""

    calibrator = AutoCalibrator(sample_tokens=1024, folder=tmp_path)
    calibrator.note(b"h" * 16, object())
    huge = KVLayout(1, 1, 4096, "float16")
    header = auto_header(b"h" * 16, 0, layout=huge, tokens=1, payload=bytes(huge.block_bytes(1)))
    assert calibrator.transcode(header, bytes(huge.block_bytes(1)))[0] is header
    assert calibrator._namespaces[b"h" * 16, huge].failed
    # 256 MiB of zeros as int8+shuffle+zstd: a few KiB that the calibrator must not decode
    bomb_layout = KVLayout(8, 8, 128, "float16")
    tokens = (256 << 20) // bomb_layout.block_bytes(1)
    small = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    header = auto_header(b"z" * 16, 1, layout=bomb_layout, tokens=tokens, payload=small, codec="int8+shuffle+zstd")
    assert calibrator.transcode(header, small)[0] is header
    assert (b"z" * 16, bomb_layout) not in calibrator._namespaces  # turned away before any state or decode
    # ... while every codec still reads what it wrote, 1-token int4 blocks (padded groups) and chains
    # of two compressors included
    for spec in ("int4-g512+shuffle+zstd", "int2-g128+lz4", "raw+zstd+lz4", "int8+lz4+zstd3", "int4+shuffle+zstd+zstd3"):
        for shape in ((2, 2, 3, 1, 16), (3, 2, 1, 17, 64)):
            x = (torch.randn(shape) * 3 + 0.5).to(torch.bfloat16)
            encoded = get_codec(spec).encode(x)
            assert get_codec(spec).decode(encoded.payload, encoded.params, shape, x.dtype).shape == shape
    # a small declared block whose zstd stage claims 256 MiB (with or without the frame saying so)
    small_layout = KVLayout(1, 1, 16, "float16")
    honest = get_codec("int8+zstd").encode(torch.randn(1, 2, 1, 4, 16).half())
    for content_size in (True, False):
        claim = zstandard.ZstdCompressor(level=19, write_content_size=content_size).compress(bytes(256 << 20))
        params = {"quant": honest.params["quant"], "stages": [{"level": 1, "size": 256 << 20}]}
        with pytest.raises(ValueError, match=r"size is 268435456; must be an integer in 0\.\.65697 \(a compressor's worst case over the quantizer's 160 bytes\)"):
            get_codec("int8+zstd").decode(claim, params, small_layout.block_shape(4), torch.float16)
        calibrator.note(b"s" * 16, object())
        header = dataclasses.replace(auto_header(b"s" * 16, 2, layout=small_layout, tokens=4, payload=claim,
                                                 codec="int8+zstd"), codec_params=params)
        assert calibrator.transcode(header, claim)[0] is header


def test_a_block_cannot_name_a_calibration_by_pattern(tmp_path, monkeypatch):
    """A block's params name its calibration, and a client writes them: never a prefix or a glob that
    could pick another tenant's calibration out of the daemon's folder."""
    calibration = calibrate([rope_keys_block(256, 0, seed=1, rotate=False)], Allocation(0.3, 0.3))
    calibration_store.save(calibration)
    for ref in ("[0-9a-f]???????", "*", "../" + calibration.id[:8], calibration.id[:12].upper()):
        with pytest.raises(ValueError, match="hex digits"):
            calibration_store.resolve(ref)
    block = rope_keys_block(64, 0, seed=2, rotate=False).to(torch.float16)
    encoded = TransformCodec(calibration).encode(block)
    with pytest.raises(ValueError, match="must be a 64-digit lower-case hex id"):
        TransformCodec(calibration).decode(encoded.payload, {**encoded.params, "calibration": calibration.id[:12]},
                                           tuple(block.shape), block.dtype)


def test_one_token_far_off_fails_the_check_though_the_block_passes():
    block = rope_keys_block(256, 0, seed=3)
    decoded = block + 0.01 * torch.randn(block.shape, generator=torch.Generator().manual_seed(1))
    total, per_token = relative_errors(block, decoded)
    assert float(total.max()) < 0.05 and float(per_token.max()) < 0.1
    spread = (block[1, 1] - block[1, 1].mean(1, keepdim=True)).pow(2).sum((0, 2)).mean()  # per token, [H, T, D]
    decoded[1, 1, :, 100] = block[1, 1, :, 100] + 0.75 * (spread / (HEADS * HEAD_DIM)).sqrt()  # 0.75 of the spread
    total, per_token = relative_errors(block, decoded)
    assert float(total.max()) <= MAX_RELATIVE_ERROR < float(per_token.max())


def test_the_reference_engine_reuses_auto_coded_blocks_from_disk(daemon_factory, short_tmp):
    """End to end with the real model: a daemon with kvtc@auto calibrates the model's namespace from
    one prompt's blocks; another prompt's blocks go to disk coded; loaded back from disk by the
    reference engine, they give the uncached run's first token."""
    import json
    from importlib import resources

    from engine_adapter.cached import CachedEngine
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.reference.generate import generate
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.reference.prompts import document_prompt
    from kvstore.keys import prefix_keys

    model, tokenizer = load_gguf(find_smollm2_gguf(), dtype=torch.float32)
    document = json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())["document"]
    paragraphs = document.split("\n\n")
    sample_doc = "\n\n".join(paragraphs[len(paragraphs) // 2:] + paragraphs[: len(paragraphs) // 2])
    d = auto_daemon(daemon_factory, short_tmp, auto_calibration_tokens="2048", cpu_capacity="256MiB")
    with KVStoreClient(d.address) as client:
        engine = CachedEngine(model, tokenizer, client)
        sampled = engine.generate(tokenizer.encode(sample_doc)[:2600], max_new_tokens=1)  # 10 chunks, 8 sampled
        assert sampled.store_done.wait(120)
        wait_for(lambda: published(client, short_tmp), timeout=60)
        context, question = document_prompt(tokenizer, document[:9000], "who wrote hannibal and scipio?")
        prompt = context + question
        expected = generate(model, tokenizer, prompt, max_new_tokens=1)
        cold = engine.generate(prompt, max_new_tokens=1)
        assert cold.reused_tokens == 0 and cold.tokens == expected and cold.store_done.wait(120)
        n_chunks = (len(prompt) - 1) // 256
        (saved,) = (short_tmp / "calibrations").glob(f"*{calibration_store.SUFFIX}")
        parts = -(-saved.stat().st_size // calibration_store.PART_BYTES)  # the calibration's blocks
        wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] >= 10 + n_chunks + parts)
        client.clear(["cpu"])
        keys = prefix_keys(engine.namespace, prompt[: len(prompt) - 1])
        with client.fetch(keys, engine.namespace.layout.block_bytes(256) + 4096) as fetched:
            assert {b.codec.split("@")[0] for b in fetched} == {"kvtc"}  # every chunk coded on disk
            coded = sum(len(b.payload) for b in fetched)
        assert coded * 4 < len(keys) * engine.namespace.layout.block_bytes(256)  # float32 blocks: > 4x smaller
        warm = engine.generate(prompt, max_new_tokens=1)
    assert warm.reused_tokens == n_chunks * 256 and set(warm.tiers) == {"disk"}
    assert warm.tokens == expected


def test_a_coded_block_may_not_claim_more_than_a_raw_one(daemon):
    """A coded block decodes to its layout's size wherever a daemon re-encodes it: one that claims
    more than the largest raw block the daemon takes (max_message_bytes) is refused at Put."""
    import grpc

    from engine_adapter.client.kvstore_client import KVStoreClient

    tokens = (512 << 20) // AUTO_LAYOUT.block_bytes(1)
    with KVStoreClient(daemon.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.put(AUTO_NS, [(b"q" * 16, tokens, b"\0" * 64)], codec="int8+zstd", codec_params={"stages": []})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over max_message_bytes" in info.value.details()
