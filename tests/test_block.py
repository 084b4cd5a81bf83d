import dataclasses

import numpy as np
import pytest

from kvstore.block import (CHECKSUM_STEP, FIXED_BYTES, MAX_HEADER_BYTES, BlockHeader, CorruptBlockError,
                           copy_checksummed, pack_token_ids, parse_block, payload_checksum)
from kvstore.keys import KVLayout

LAYOUT = KVLayout(4, 3, 64, "float16")


def _block(tokens: int = 37, codec: str = "raw", params: dict | None = None, payload: bytes | None = None):
    rng = np.random.default_rng(tokens)
    if payload is None:
        payload = rng.standard_normal(LAYOUT.block_bytes(tokens) // 2).astype(np.float16).tobytes()
    header = BlockHeader(key=rng.bytes(16), namespace=rng.bytes(16), layout=LAYOUT, tokens=tokens,
                         payload_len=len(payload), checksum=payload_checksum(payload), codec=codec,
                         codec_params=params or {})
    return header, payload


def test_round_trip_keeps_every_field():
    header, payload = _block(codec="int4", params={"group": 32, "bits": 4, "scales": [1.5, 2.25]},
                             payload=b"\x01\x02" * 999)
    packed = header.pack()
    assert len(packed) == header.header_len and header.header_len % 64 == 0 and len(packed) >= FIXED_BYTES
    parsed, view = parse_block(packed + payload)
    assert parsed == header and bytes(view) == payload


@pytest.mark.parametrize("offset", [0, 5, 10, 30, 41, 50, 75, 104, 112])
def test_any_flipped_header_byte_is_detected(offset):
    header, payload = _block()
    packed = bytearray(header.pack())
    packed[offset] ^= 0x40
    with pytest.raises(CorruptBlockError):
        parse_block(bytes(packed) + payload)


def test_flipped_payload_byte_and_truncation_are_detected():
    header, payload = _block()
    damaged = bytearray(payload)
    damaged[len(damaged) // 3] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        parse_block(header.pack() + bytes(damaged))
    with pytest.raises(CorruptBlockError):
        parse_block(header.pack() + payload[:-10])
    with pytest.raises(CorruptBlockError):
        parse_block(header.pack()[:50])


def test_raw_payload_must_match_layout():
    with pytest.raises(ValueError, match="must be"):
        BlockHeader(key=b"k" * 16, namespace=b"n" * 16, layout=LAYOUT, tokens=10, payload_len=123, checksum=0)


@pytest.mark.parametrize("path", ["kernel", "python"])  # kernels/copy_hash.c where it applies, or the fallback
@pytest.mark.parametrize("step", [CHECKSUM_STEP, 0])  # a step per chunk (on the loop), or whole (in a thread)
@pytest.mark.parametrize("size", [0, 1, 63, CHECKSUM_STEP - 1, CHECKSUM_STEP, CHECKSUM_STEP + 1, 5 * CHECKSUM_STEP + 500])
def test_copy_checksummed_copies_and_hashes_as_the_one_shot_checksum(size, step, path, monkeypatch):
    if path == "python":
        monkeypatch.setattr("kvstore.block.native_copies", lambda: None)
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dest = bytearray(size)
    assert copy_checksummed(memoryview(dest), memoryview(payload), step) == payload_checksum(payload.tobytes())
    assert bytes(dest) == payload.tobytes()
    with pytest.raises(ValueError):
        copy_checksummed(memoryview(bytearray(size + 1)), payload.tobytes())


@pytest.mark.parametrize("tokens", [1, 4, 37, 256])
@pytest.mark.parametrize("parts", ["parent", "token_ids", "both"])
def test_a_chain_in_the_header_round_trips_and_every_byte_of_it_is_checked(tokens, parts):
    """The parent and token ids a daemon keeps for KV events (``kvstore.block``: flag bits 0 and 1)
    come back as stored, whatever the token count and padding; a flipped byte in them, or a flag
    naming a chain that is not there, is a corrupt block."""
    header, payload = _block(tokens)
    rng = np.random.default_rng(tokens + 7)
    ids = rng.integers(0, 2**32, size=tokens, dtype=np.uint64).tolist()
    chained = dataclasses.replace(header, parent=rng.bytes(16) if parts != "token_ids" else b"",
                                  token_ids=pack_token_ids(ids) if parts != "parent" else b"")
    packed = chained.pack()
    assert len(packed) == chained.header_len <= MAX_HEADER_BYTES and chained.header_len % 64 == 0
    parsed, view = parse_block(packed + payload)
    assert parsed == chained and bytes(view) == payload
    assert parsed.token_id_list() == (ids if parts != "parent" else [])
    start = FIXED_BYTES + len(chained.params_json)
    for offset in range(start, start + len(chained.chain), max(1, len(chained.chain) // 13)):
        damaged = bytearray(packed)
        damaged[offset] ^= 0x10
        with pytest.raises(CorruptBlockError):
            parse_block(bytes(damaged) + payload)
    damaged = bytearray(header.pack())
    damaged[47] = 0x03  # both flags on a header without a chain: its checksum no longer holds
    with pytest.raises(CorruptBlockError):
        parse_block(bytes(damaged) + payload)
    damaged[47] = 0x80  # a flag this format does not know
    with pytest.raises(CorruptBlockError, match="flags"):
        parse_block(bytes(damaged) + payload)


def test_token_ids_must_be_the_blocks_own():
    header, _ = _block(37)
    with pytest.raises(ValueError, match="token_ids"):
        dataclasses.replace(header, token_ids=pack_token_ids(range(36)))
    with pytest.raises(ValueError, match="parent"):
        dataclasses.replace(header, parent=b"short")
