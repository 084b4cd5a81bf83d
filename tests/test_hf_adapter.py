"""transformers (HF) prefix reuse through the daemon, and KV interchange with the reference engine.

Real SmolLM2-135M (GGUF, fp32) on both engines and a real daemon subprocess per test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_adapter.cached import CachedEngine, model_namespace
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
from kvstore.keys import prefix_keys

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # loads the real SmolLM2 twice

from engine_adapter.hf_adapter import (HFCachedGenerator, blocks_from_cache, cache_from_blocks,  # noqa: E402
                                      cache_over, hf_namespace)
from engine_adapter.reference.kv_cache import KVCache  # noqa: E402

CHUNK = 256
NEW_TOKENS = 12
STORE_TIMEOUT_S = 30
KV_TOLERANCE = 1e-3  # max abs difference between the two engines' fp32 KV (logits agree to 1e-4)
DOCUMENT = Path(__file__).resolve().parent.parent / "engine_adapter" / "data" / "musique_sample.json"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for this module: on a small shared CPU, spinning OpenMP threads made it 3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gguf_path():
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def model_id(gguf_path) -> str:
    return gguf_path.stem  # what load_gguf names the reference model


@pytest.fixture(scope="module")
def reference(gguf_path):
    return load_gguf(gguf_path, dtype=torch.float32)  # (LlamaModel, Tokenizer)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def document_ids(reference) -> list[int]:
    _, tokenizer = reference
    text = json.loads(DOCUMENT.read_text())["document"]
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def prompt_ids(document_ids) -> list[int]:
    """600 tokens of real text: 2 full chunks and a partial one, so 512 tokens are reusable."""
    assert len(document_ids) >= 600
    return document_ids[:600]


@pytest.fixture(scope="module")
def expected_tokens(hf_model, prompt_ids) -> list[int]:
    """transformers' own greedy generate on the prompt, without any kvstore involvement."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


# --- (1) layout ----------------------------------------------------------------------------------------


def test_blocks_round_trip_and_match_reference_layout(hf_model, reference, document_ids, model_id):
    ids = document_ids[:130]
    with torch.inference_mode():
        cache = hf_model(torch.tensor([ids]), use_cache=True).cache
    cuts = [0, 37, 100, 130]  # irregular pieces
    blocks = [blocks_from_cache(cache, a, b) for a, b in zip(cuts, cuts[1:])]
    config = hf_model.config
    assert blocks[0].shape == (config.num_hidden_layers, 2, config.num_key_value_heads, 37, 64)
    rebuilt = cache_from_blocks(blocks, config)
    assert rebuilt.get_seq_length() == len(ids)
    for original, copy in zip(cache.layers, rebuilt.layers):
        assert copy.keys.shape == original.keys.shape == (1, config.num_key_value_heads, len(ids), 64)
        assert torch.equal(copy.keys, original.keys) and torch.equal(copy.values, original.values)
    assert torch.equal(blocks_from_cache(rebuilt, 0, len(ids)), torch.cat(blocks, dim=3))

    # Same layout as the reference engine's export: keys after RoPE at absolute positions, K then V.
    model, _ = reference
    kv = model.new_cache(len(ids))
    with torch.inference_mode():
        model(torch.tensor(ids), kv, 0, last_only=True)
    ours, theirs = kv.export(0, len(ids)), blocks_from_cache(cache, 0, len(ids))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= KV_TOLERANCE
    assert hf_namespace(hf_model, model_id) == model_namespace(model)
    assert hf_namespace(hf_model, model_id).id == model_namespace(model).id
    assert hf_namespace(hf_model, model_id, tenant="t").id != model_namespace(model).id


def test_a_cache_over_a_kv_cache_views_it_and_equals_one_built_from_blocks(hf_model):
    config = hf_model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    kv = KVCache(layers, kv_heads, head_dim, 40, torch.float32, "cpu")
    kv.data.normal_(generator=torch.Generator().manual_seed(3))
    kv.length = 40
    over = cache_over(kv, 37, config)
    built = cache_from_blocks([kv.export(0, 20), kv.export(20, 37)], config)
    assert over.get_seq_length() == built.get_seq_length() == 37
    for a, b in zip(over.layers, built.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert over.layers[0].keys.data_ptr() == kv.data.data_ptr()  # a view: no copy
    assert cache_over(kv, 0, config).get_seq_length() == 0


# --- (2) HF cold then warm ---------------------------------------------------------------------------


def test_hf_warm_reuses_prefix_with_identical_tokens(hf_model, reference, prompt_ids, expected_tokens,
                                                     model_id, daemon):
    _, tokenizer = reference
    with KVStoreClient(daemon.address) as client:
        generator = HFCachedGenerator(hf_model, tokenizer, client, model_id, chunk_tokens=CHUNK)
        cold = generator.generate(prompt_ids, NEW_TOKENS)
        assert cold.reused_tokens == 0 and cold.stored_chunks == 2
        assert cold.store_done.wait(STORE_TIMEOUT_S)
        assert generator._allocate is not None  # shared memory: the warm load is one copy (PrefixCache.load)
        warm = generator.generate(prompt_ids, NEW_TOKENS)
        assert warm.reused_tokens >= 512 and len(warm.tiers) == 2
        assert warm.stored_chunks == 0
        assert cold.tokens == warm.tokens == expected_tokens
        assert generator.errors == 0

        # A daemon that goes away costs misses, never an exception (small chunks keep this cheap).
        small = HFCachedGenerator(hf_model, tokenizer, client, model_id, chunk_tokens=16)
        daemon.stop()
        down = small.generate(prompt_ids[:40], 2)
        assert down.reused_tokens == 0 and len(down.tokens) == 2
        assert down.store_done.wait(STORE_TIMEOUT_S)
        assert small.errors == 2  # the lookup and the put


# --- (3) cross-engine -------------------------------------------------------------------------------


def test_blocks_are_shared_between_engines(hf_model, reference, prompt_ids, expected_tokens, model_id, daemon):
    model, tokenizer = reference
    with KVStoreClient(daemon.address) as client:
        engine = CachedEngine(model, tokenizer, client, chunk_tokens=CHUNK)
        generator = HFCachedGenerator(hf_model, tokenizer, client, model_id, chunk_tokens=CHUNK)
        assert generator.namespace.id == engine.namespace.id

        # reference engine stores, HF loads
        ref_cold = engine.generate(prompt_ids, NEW_TOKENS)
        assert ref_cold.store_done.wait(STORE_TIMEOUT_S) and ref_cold.stored_chunks == 2
        hf_warm = generator.generate(prompt_ids, NEW_TOKENS, store=False)
        assert hf_warm.reused_tokens == 512
        assert hf_warm.tokens == ref_cold.tokens == expected_tokens

        # HF stores, reference engine loads (same prompt, daemon emptied first)
        assert client.clear() >= 2  # a block may be counted once per tier holding it
        assert client.lookup(generator_keys(generator, prompt_ids)).hits == 0
        hf_cold = generator.generate(prompt_ids, NEW_TOKENS)
        assert hf_cold.store_done.wait(STORE_TIMEOUT_S) and hf_cold.stored_chunks == 2
        ref_warm = engine.generate(prompt_ids, NEW_TOKENS, store=False)
        assert ref_warm.reused_tokens == 512
        assert ref_warm.tokens == hf_cold.tokens == ref_cold.tokens
        assert generator.errors == engine.errors == 0


def generator_keys(generator: HFCachedGenerator, ids: list[int]) -> list[bytes]:
    return prefix_keys(generator.namespace, ids[:-1])
