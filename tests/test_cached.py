"""Cached generation with the real SmolLM2 model and the real daemon."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from engine_adapter.cached import CachedEngine
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.generate import generate
from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
from engine_adapter.reference.prompts import document_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_gguf(find_smollm2_gguf(), dtype=torch.float32)


@pytest.fixture(scope="module")
def document() -> str:
    sample = json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())
    return sample["document"][:3000]  # ~700 tokens: 2 full chunks and a tail


def test_warm_generation_is_token_for_token_the_uncached_one(smollm2, document, daemon):
    model, tokenizer = smollm2
    context, question = document_prompt(tokenizer, document, "who wrote hannibal and scipio?")
    prompt = context + question
    expected = generate(model, tokenizer, prompt, max_new_tokens=12)
    with KVStoreClient(daemon.address) as client:
        engine = CachedEngine(model, tokenizer, client)
        cold = engine.generate(prompt, max_new_tokens=12)
        assert cold.reused_tokens == 0 and cold.tokens == expected
        assert cold.store_done.wait(60) and engine.errors == 0
        warm = engine.generate(prompt, max_new_tokens=12)
        assert warm.reused_tokens == (len(prompt) - 1) // 256 * 256 >= 512
        assert warm.tiers == ["cpu"] * (warm.reused_tokens // 256)
        assert warm.tokens == expected
        # Another question over the same document reuses the document's chunks.
        context2, question2 = document_prompt(tokenizer, document, "what is red dragon?")
        assert context2 == context
        other = engine.generate(context2 + question2, max_new_tokens=8)
        assert other.reused_tokens == len(context) // 256 * 256
        assert other.tokens == generate(model, tokenizer, context2 + question2, max_new_tokens=8)


def test_ingest_then_hit_from_disk_after_restart(smollm2, document, daemon):
    model, tokenizer = smollm2
    context, question = document_prompt(tokenizer, document, "when was the play first performed?")
    with KVStoreClient(daemon.address) as client:
        engine = CachedEngine(model, tokenizer, client)
        stored, present = engine.ingest(context)
        assert (stored, present) == (len(context) // 256, 0)
        assert engine.ingest(context) == (0, stored)
    daemon.stop()
    daemon.start()
    with KVStoreClient(daemon.address) as client:
        engine = CachedEngine(model, tokenizer, client)
        result = engine.generate(context + question, max_new_tokens=8, store=False)
        assert result.tiers == ["disk"] * stored
        assert result.tokens == generate(model, tokenizer, context + question, max_new_tokens=8)


def test_a_daemon_that_is_down_costs_misses_not_requests(smollm2, document, daemon):
    model, tokenizer = smollm2
    context, question = document_prompt(tokenizer, document, "who?")
    client = KVStoreClient(daemon.address, timeout=2)
    daemon.stop(signal_kill=True)
    engine = CachedEngine(model, tokenizer, client)
    result = engine.generate(context + question, max_new_tokens=4)
    assert result.store_done.wait(30)
    assert result.reused_tokens == 0 and len(result.tokens) >= 1 and engine.errors >= 1
    assert result.tokens == generate(model, tokenizer, context + question, max_new_tokens=4)


def test_layerwise_loading_gives_the_same_tokens(smollm2, document, daemon):
    model, tokenizer = smollm2
    context, question = document_prompt(tokenizer, document, "what is hannibal?")
    prompt = context + question
    with KVStoreClient(daemon.address) as client:
        engine = CachedEngine(model, tokenizer, client)
        cold = engine.generate(prompt, max_new_tokens=8)
        assert cold.store_done.wait(60)
        plain = engine.generate(prompt, max_new_tokens=8, store=False)
        layered = engine.generate(prompt, max_new_tokens=8, store=False, layerwise=True)
        assert layered.reused_tokens == plain.reused_tokens >= 512 and engine.errors == 0
        assert layered.tiers == plain.tiers
        assert layered.tokens == plain.tokens == cold.tokens
