import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import KVLayout, Namespace, chunk_key, chunk_spans, prefix_keys

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
NS = Namespace("SmolLM2-135M-Instruct", LAYOUT, rope=Namespace.rope_params(theta=100000.0), chunk_tokens=16)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, size=n).tolist()


def test_only_full_chunks_get_keys():
    assert len(prefix_keys(NS, _tokens(16 * 3 + 5))) == 3
    assert prefix_keys(NS, _tokens(15)) == []
    spans = chunk_spans(NS, _tokens(40))
    assert [(s.start, s.end) for s in spans] == [(0, 16), (16, 32)]


def test_keys_chain_through_the_prefix():
    a, b = _tokens(64, 1), _tokens(64, 1)
    b[3] += 1  # change one token of chunk 0
    ka, kb = prefix_keys(NS, a), prefix_keys(NS, b)
    assert all(x != y for x, y in zip(ka, kb)), "a change in chunk 0 must change every later key"
    c = list(a)
    c[40] += 1  # chunk 2
    kc = prefix_keys(NS, c)
    assert kc[:2] == ka[:2] and kc[2] != ka[2] and kc[3] != ka[3]


@pytest.mark.parametrize("change", [
    dict(model_id="other-model"),
    dict(layout=KVLayout(30, 3, 64, "bfloat16")),
    dict(layout=KVLayout(30, 3, 128, "float16")),
    dict(tenant="tenant-b"),
    dict(rope=Namespace.rope_params(theta=10000.0)),
    dict(chunk_tokens=32),
])
def test_namespace_separates_models_dtypes_tenants(change):
    other = Namespace(**{**dict(model_id=NS.model_id, layout=NS.layout, rope=NS.rope, tenant=NS.tenant,
                                chunk_tokens=NS.chunk_tokens), **change})
    tokens = _tokens(64)
    assert other.id != NS.id
    assert set(prefix_keys(other, tokens)).isdisjoint(prefix_keys(NS, tokens))
    assert chunk_key(other, tokens[:16]) != chunk_key(NS, tokens[:16])


def test_chunk_key_ignores_position_prefix_key_does_not():
    tokens = _tokens(48)
    chunk = tokens[16:32]
    assert chunk_key(NS, chunk) == chunk_key(NS, list(chunk))
    assert chunk_key(NS, chunk) != prefix_keys(NS, tokens)[1]
    assert chunk_key(NS, chunk) != chunk_key(NS, tokens[:16])


def test_keys_are_deterministic_across_processes():
    tokens = _tokens(16 * 5)
    code = (
        "import sys, json; from kvstore.keys import *\n"
        "ns = Namespace('SmolLM2-135M-Instruct', KVLayout(30, 3, 64, 'float16'), "
        "rope=Namespace.rope_params(theta=100000.0), chunk_tokens=16)\n"
        "tokens = json.loads(sys.stdin.read())\n"
        "print(','.join(k.hex() for k in prefix_keys(ns, tokens)) + ';' + chunk_key(ns, tokens[:16]).hex())\n"
    )
    import json
    outputs = {
        subprocess.run([sys.executable, "-c", code], input=json.dumps(tokens), capture_output=True, text=True,
                       check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    here = ",".join(k.hex() for k in prefix_keys(NS, tokens)) + ";" + chunk_key(NS, tokens[:16]).hex()
    assert outputs == {here}


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(30, 3, 64, "float64")
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(0, 3, 64, "float16")
    with pytest.raises(ValueError, match="model_id"):
        Namespace("", LAYOUT)
    with pytest.raises(ValueError, match="int32"):
        prefix_keys(NS, [-1] * 16)


@pytest.mark.parametrize("page", [1, 16, 96, 128, 256, 512])
@pytest.mark.parametrize("length", [0, 1, 100, 255, 256, 257, 383, 700, 1023])
def test_paged_prefix_keys_reach_the_last_page_boundary(page, length):
    from kvstore.keys import paged_prefix_keys, tail_key

    ns = Namespace("m", KVLayout(2, 1, 4, "float16"), chunk_tokens=256)
    tokens = np.random.default_rng(length).integers(0, 50_000, length)
    keys, tail = paged_prefix_keys(ns, tokens, page)
    full = prefix_keys(ns, tokens)
    assert keys[: len(full)] == full  # full chunks keep every engine's keys
    covered = len(full) * 256 + tail
    assert covered == max(length // page * page, len(full) * 256)  # the last page boundary (or chunk)
    assert 0 <= tail < 256 and len(keys) == len(full) + (tail > 0)
    if tail:
        assert keys[-1] == tail_key(ns, full[-1] if full else None, tokens[len(full) * 256 : covered])
        assert keys[-1] not in full


def test_tail_keys_are_their_own_domain():
    from kvstore.keys import prefix_key, tail_key

    ns = Namespace("m", KVLayout(2, 1, 4, "float16"), chunk_tokens=4)
    assert tail_key(ns, None, [1, 2, 3]) != prefix_key(ns, None, [1, 2, 3])
    assert tail_key(ns, None, [1, 2, 3]) != tail_key(ns, None, [1, 2])
    parent = prefix_key(ns, None, [9, 9, 9, 9])
    assert tail_key(ns, parent, [1, 2]) != tail_key(ns, None, [1, 2])
    for bad in ([], [1, 2, 3, 4]):
        with pytest.raises(ValueError, match="tail holds"):
            tail_key(ns, None, bad)
