"""Cluster lookup against real daemons holding different prefix lengths, one of them stopped."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.keys import prefix_keys
from kvstore.locate import locate
from tests.test_daemon import BLOCK, NS, make_blocks


@pytest.fixture
def three_daemons(daemon_factory):
    """Daemons holding the first 2, 5 (3 of them on disk only) and 4 chunks of one prompt; the
    third is then stopped."""
    keys, payloads = make_blocks(6, seed=51)
    daemons = [daemon_factory(f"d{i}") for i in range(3)]
    for d, held in zip(daemons, (2, 5, 4)):
        with KVStoreClient(d.address) as client:
            client.put(NS, [(k, 64, p) for k, p in zip(keys[:held], payloads[:held])])
    with KVStoreClient(daemons[1].address) as client:
        client.clear(["cpu"])  # the write-through copies on disk stay
    daemons[2].stop()
    return daemons, keys


def test_locate_names_the_longest_prefix_and_reports_the_stopped_host(three_daemons):
    daemons, keys = three_daemons
    result = locate([d.address for d in daemons], keys, deadline_s=2.0)
    first, second, stopped = result.hosts
    assert (first.hits, first.tiers) == (2, ("cpu", "cpu"))
    assert second.hits == 5 and set(second.tiers) == {"disk"}
    assert not stopped.answered and stopped.error.startswith("UNAVAILABLE") and stopped.hits == 0
    assert result.best == second and result.keys == len(keys)
    # Equal runs: the faster tiers win.
    assert locate([daemons[1].address, daemons[0].address], keys[:2]).best.address == daemons[0].address


def test_locate_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        locate([], [b"k" * 16])
    with pytest.raises(ValueError, match="16 bytes"):
        locate(["unix:/nowhere"], [b"short"])


def test_locate_command_with_token_ids(daemon_factory, short_tmp):
    """The CLI computes the keys of the bundled model's namespace from token ids."""
    from engine_adapter.cached import config_namespace
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config

    try:
        config, _ = gguf_config(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    namespace = config_namespace(config, "float32")
    tokens = np.random.default_rng(5).integers(0, 40000, size=3 * namespace.chunk_tokens + 17).tolist()
    keys = prefix_keys(namespace, tokens)
    held, stopped = daemon_factory("held"), daemon_factory("stopped")
    payload = np.zeros(namespace.layout.block_bytes(namespace.chunk_tokens), np.uint8)  # 11.8 MB
    with KVStoreClient(held.address) as client:
        client.put(namespace, [(k, namespace.chunk_tokens, payload) for k in keys[:2]])
    stopped.stop()
    token_file = short_tmp / "prompt.json"
    token_file.write_text(json.dumps(tokens))
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "locate", "--hosts",
                          f"{held.address},{stopped.address}", "--tokens", str(token_file), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["keys"] == 3 and answer["best"] == held.address
    assert [(h["hits"], h["error"][:11]) for h in answer["hosts"]] == [(2, ""), (0, "UNAVAILABLE")]
