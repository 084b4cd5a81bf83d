"""The reference engine (engine_adapter) against transformers, on SmolLM2 and on tiny random models."""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import subprocess
import typing

import pytest
import torch

from engine_adapter.reference.generate import decode_after, decode_loop, generate, prefill, sample_next
from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf, load_hf_folder
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.reference.model import LlamaModel, ModelConfig
from engine_adapter.reference.tokenizer import Tokenizer, byte_alphabet

LOGITS_TOLERANCE = 1e-4  # max abs difference in fp32

TOKENIZER_TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "Numbers: 1234567 and 3.14159, dates 2024-06-01.",
    "Unicode: café, naïve, Straße, 日本語のテキスト, emoji 🙂👍🏽.",
    "Tabs\tand\n\nnewlines\r\n  indented    runs of spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say it's John's, we've seen THAT'S odd",
]

CHAT = [{"role": "user", "content": "Name three primary colors."}]


def long_text() -> str:
    """Real prose and code from the standard library's docs and sources (no repetition)."""
    docs = [module.__doc__ for module in (argparse, subprocess, typing, re, json, collections, functools)]
    return "\n\n".join(doc for doc in docs if doc)


# --- fixtures: each model loads once per module ------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path():
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def engine(gguf_path) -> tuple[LlamaModel, Tokenizer]:
    return load_gguf(gguf_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


def engine_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(ids), model.new_cache(len(ids)), 0)  # [T, vocab]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()  # [T, vocab]


# --- (1) tokenizer ------------------------------------------------------------------------------


@pytest.mark.slow
def test_tokenizer_matches_transformers(engine, hf_tokenizer):
    _, tokenizer = engine
    for text in TOKENIZER_TEXTS + [long_text()]:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text[:60]
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids)
    assert tokenizer.encode("hi", add_bos=True)[0] == tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2,)


@pytest.mark.slow
def test_chat_template_matches_transformers(engine, hf_tokenizer):
    _, tokenizer = engine
    for add_generation_prompt in (True, False):
        ours = tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
        theirs = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert ours == theirs


# --- (2) logits against transformers ------------------------------------------------------------


@pytest.mark.slow
def test_logits_match_transformers(engine, hf_model):
    model, tokenizer = engine
    long_ids = tokenizer.encode(long_text())
    assert len(long_ids) >= 2000
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(CHAT)),
        tokenizer.encode("The capital of France is Paris. The capital of Germany is"),
        long_ids[:2048],
    ]
    for ids in prompts:
        ours, theirs = engine_logits(model, ids), hf_logits(hf_model, ids)
        assert ours.shape == theirs.shape == (len(ids), model.config.vocab_size)
        assert (ours - theirs).abs().max().item() <= LOGITS_TOLERANCE, len(ids)


@pytest.mark.slow
def test_greedy_generate_follows_transformers_argmax(engine, hf_model):
    model, tokenizer = engine
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    new_ids = generate(model, tokenizer, prompt, max_new_tokens=8)
    assert 1 <= len(new_ids) <= 8
    # Each generated token is transformers' greedy choice after the tokens before it.
    theirs = hf_logits(hf_model, prompt + new_ids)  # [T, vocab]
    assert theirs[len(prompt) - 1:-1].argmax(-1).tolist() == new_ids[: len(new_ids)]


# --- (3) incremental decode == one full forward -------------------------------------------------


@pytest.mark.slow
def test_incremental_decode_matches_full_forward(engine):
    model, tokenizer = engine
    ids = tokenizer.encode(long_text())[:120]
    full = engine_logits(model, ids)  # [120, vocab]

    # positions:  0 ...... 63 | 64 ...... 99 | 100 101 ... 119
    #             prefill      chunk (masked)  one token at a time
    kv = model.new_cache(16)  # small on purpose: forces the cache to grow
    with torch.inference_mode():
        pieces = [model(torch.tensor(ids[:64]), kv, 0), model(torch.tensor(ids[64:100]), kv, 64)]
        pieces += [model(torch.tensor([token]), kv, pos) for pos, token in enumerate(ids[100:], start=100)]
    assert kv.length == len(ids) and kv.capacity >= len(ids)
    incremental = torch.cat(pieces)
    assert (incremental - full).abs().max().item() <= LOGITS_TOLERANCE


# --- (4) export / load round trip ---------------------------------------------------------------


@pytest.mark.slow
def test_export_load_reproduces_next_token_logits(engine):
    model, tokenizer = engine
    ids = tokenizer.encode("Block storage keeps the KV of a shared prefix so the next request skips it.")
    config = model.config
    kv = model.new_cache(len(ids) + 1)
    next_logits = prefill(model, ids[:-1], kv, start_pos=0)
    blocks = [kv.export(0, 7), kv.export(7, kv.length)]
    assert blocks[0].shape == (config.num_layers, 2, config.num_kv_heads, 7, config.head_dim)

    fresh = model.new_cache(4)
    for block, start in zip(blocks, (0, 7)):
        fresh.load(block, start)
    assert fresh.length == kv.length == len(ids) - 1
    assert torch.equal(fresh.export(0, fresh.length), kv.export(0, kv.length))
    with torch.inference_mode():
        expected = model(torch.tensor(ids[-1:]), kv, kv.length)
        restored = model(torch.tensor(ids[-1:]), fresh, fresh.length)
    assert (restored - expected).abs().max().item() <= LOGITS_TOLERANCE
    assert next_logits.shape == (config.vocab_size,)


# --- (5) tiny random models through the Hugging Face folder path ----------------------------------


def tiny_hf_model(family: str):
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if family == "qwen2":  # q/k/v biases, llama3 rope scaling, tied embeddings
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = transformers.Qwen2Config(**shape, rope_parameters=rope, tie_word_embeddings=True,
                                          use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(config)
    else:  # no biases, linear rope scaling, separate LM head
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        config = transformers.LlamaConfig(**shape, rope_parameters=rope, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.eval()


def save_byte_tokenizer(folder) -> None:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {symbol: index for index, symbol in enumerate(byte_alphabet().values())}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_hf_folder_matches_transformers(family, tmp_path):
    hf = tiny_hf_model(family)
    hf.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    model, tokenizer = load_hf_folder(tmp_path, dtype=torch.float32)

    config = model.config
    assert config.attention_bias == (family == "qwen2")
    assert config.tie_word_embeddings == (family == "qwen2")
    assert config.rope_type == ("llama3" if family == "qwen2" else "linear")
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert tokenizer.decode(tokenizer.encode("héllo wörld")) == "héllo wörld"

    # Same weights under the mapped names.
    ours = model.state_dict()
    for name, tensor in hf.state_dict().items():
        mapped = name.removeprefix("model.").replace(".self_attn.", ".").replace(".mlp.", ".")
        assert torch.equal(ours[mapped], tensor), name

    ids = torch.randint(3, config.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    full = engine_logits(model, ids)
    assert (full - hf_logits(hf, ids)).abs().max().item() <= LOGITS_TOLERANCE
    kv = model.new_cache(8)
    with torch.inference_mode():
        stepped = torch.cat([model(torch.tensor(ids[:100]), kv, 0)]
                            + [model(torch.tensor([t]), kv, pos) for pos, t in enumerate(ids[100:], start=100)])
    assert (stepped - full).abs().max().item() <= LOGITS_TOLERANCE


# --- units without a real model ---------------------------------------------------------------


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, attention_bias=False, max_position_embeddings=128,
                  bos_token_id=1, eos_token_ids=(2,), model_id="tiny")
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("overrides", [
    dict(num_kv_heads=3),
    dict(head_dim=7),
    dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
    dict(eos_token_ids=[2]),
    dict(eos_token_ids=(999,)),
    dict(model_id=""),
])
def test_model_config_rejects_bad_values(overrides):
    with pytest.raises(ValueError):
        tiny_config(**overrides)


def test_kv_cache_bookkeeping():
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, capacity=2, dtype=torch.float32, device="cpu")
    block = torch.randn(2, 2, 2, 5, 4)  # [layers, 2, kv_heads, tokens, head_dim]
    kv.load(block, 0)
    assert (kv.length, kv.capacity) == (5, 8)
    kv.load(block[:, :, :, :2], 4)  # overlaps the end: length grows to 6
    assert kv.length == 6
    assert torch.equal(kv.export(0, 4), block[:, :, :, :4])
    assert torch.equal(kv.export(4, 6), block[:, :, :, :2])
    kv.truncate(3)
    assert kv.length == 3
    with pytest.raises(ValueError):
        kv.export(0, 4)
    with pytest.raises(ValueError):
        kv.load(block, 5)  # would leave a gap at 3..4
    with pytest.raises(ValueError):
        kv.load(torch.randn(2, 2, 3, 1, 4), 0)  # wrong kv_heads
    with pytest.raises(ValueError):
        kv.truncate(4)


def test_attend_with_explicit_mask_matches_causal():
    torch.manual_seed(0)
    model = LlamaModel(tiny_config()).eval()
    layer = model.layers[0]
    h = torch.randn(6, 32)
    cos, sin = model.rope(torch.arange(6))
    with torch.inference_mode():
        q, k, v = layer.qkv(h, cos, sin)  # [4, 6, 8], [2, 6, 8], [2, 6, 8]
        causal = layer.attend(q, k, v)
        masked = layer.attend(q, k, v, mask=torch.ones(6, 6, dtype=torch.bool).tril())
        tail = layer.attend(q[:, 4:], k, v)  # last two queries against all six keys
    assert q.shape == (4, 6, 8) and k.shape == v.shape == (2, 6, 8)
    assert torch.allclose(causal, masked, atol=1e-6)
    assert torch.allclose(causal[4:], tail, atol=1e-6)


def test_sample_next():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample_next(logits, temperature=0.0) == 1
    generator = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, temperature=1.0, top_p=0.5, generator=generator) for _ in range(20)}
    assert picks == {1}  # token 1 alone holds >= 50% of the mass
    picks = {sample_next(logits, temperature=1.0, top_p=0.99, generator=generator) for _ in range(50)}
    assert picks == {1, 2}
    with pytest.raises(ValueError):
        sample_next(logits, temperature=-1.0)


def test_decode_loop_stops_on_eos():
    torch.manual_seed(0)
    model = LlamaModel(tiny_config()).eval()
    kv = model.new_cache(4)
    logits = prefill(model, [1, 5, 9], kv, start_pos=0)
    eos = int(logits.argmax())  # greedy picks it first
    assert decode_loop(model, kv, logits, max_new_tokens=5, eos_token_ids=[eos]) == [eos]
    ids = decode_loop(model, kv, logits, max_new_tokens=5, eos_token_ids=[63 if eos != 63 else 62])
    assert len(ids) <= 5 and kv.length == 3 + len(ids) - 1


def test_bfloat16_cache_follows_model_dtype():
    torch.manual_seed(0)
    model = LlamaModel(tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    reference = model.eval()
    ids = torch.tensor([1, 7, 3, 9, 4, 11])
    with torch.inference_mode():
        expected = reference(ids, reference.new_cache(8), 0)
        half = LlamaModel(model.config).to(dtype=torch.bfloat16)
        half.load_state_dict(model.state_dict())
        kv = half.new_cache(2)
        logits = torch.cat([half(ids[:4], kv, 0), half(ids[4:], kv, 4)])
    assert kv.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.01 * expected.abs().max()  # bf16 has ~3 significant digits


def test_decode_after_a_sampled_first_token_matches_decoding_from_its_logits():
    torch.manual_seed(0)
    model = LlamaModel(tiny_config()).eval()
    prompt, never = [1, 5, 9], [10_000]  # an EOS id the tiny vocab never produces
    kv = model.new_cache(16)
    logits = prefill(model, prompt, kv, start_pos=0)
    expected = decode_loop(model, kv, logits, max_new_tokens=6, eos_token_ids=never)
    kv = model.new_cache(16)
    first = sample_next(prefill(model, prompt, kv, start_pos=0))
    assert decode_after(model, kv, first, 6, never) == expected
    assert decode_after(model, kv, first, 1, never) == [first]
    assert decode_after(model, kv, first, 6, [first]) == [first]  # an EOS first token ends the answer
