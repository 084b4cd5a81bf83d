"""Blend requests for vLLM (engine_adapter/vllm/blend.py): parameters validated, prompts built as
``BlendEngine`` splits them, passages found from separators in a prompt tokenized whole. Pure
Python: runs in the main suite, no vLLM needed."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from blend.controller import Ratio
from blend.prompt import DEFAULT_SEPARATOR, BlendPrompt, split_prompt
from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
from engine_adapter.vllm.blend import (BLEND_PARAM, BlendSpec, blend_request, blend_spec, check_blend_cost,
                                       separated_spec)


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_config(find_smollm2_gguf())[1]


def test_no_blend_parameters_mean_no_blend():
    assert blend_spec(None, 10) is None
    assert blend_spec({}, 10) is None
    assert blend_spec({"other": 1}, 10) is None


@pytest.mark.parametrize("spec, match", [
    ([3, 4], "must be an object"),
    ({"lengths": []}, "lengths must be a list"),
    ({"lengths": [1, "2"]}, "lengths must be a list"),
    ({"lengths": [True, 2]}, "lengths must be a list"),
    ({"lengths": [-1, 2]}, "prefix must be >= 0"),
    ({"lengths": [2, 0]}, "every passage > 0"),
    ({"lengths": [4, 6]}, "query needs at least one"),
    ({"lengths": [1, 2], "ratio": 1.5}, "ratio must be a number"),
    ({"lengths": [1, 2], "ratio": True}, "ratio must be a number"),
    ({"lengths": [1, 2], "ratio": "most"}, "ratio must be a number"),
    ({"lengths": [1, 2], "selector": "nope"}, "selector 'nope' is unknown"),
    ({"lengths": [1, 2], "lenghts": [1]}, "unknown keys"),
])
def test_malformed_blend_parameters_are_refused_in_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        blend_spec({BLEND_PARAM: spec}, 10)
    assert "\n" not in str(info.value)


def test_blend_spec_cuts_the_prompt_into_its_parts():
    spec = blend_spec({BLEND_PARAM: {"lengths": [2, 3, 1], "ratio": 0.3, "selector": "sinks"}}, 9)
    assert spec == BlendSpec((2, 3, 1), Ratio(0.3), "sinks") and spec.cached_tokens == 6
    assert spec.parts(range(9)) == ([0, 1], [[2, 3, 4], [5]], [6, 7, 8], [[], []])
    assert blend_spec({BLEND_PARAM: {"lengths": [0, 4], "ratio": "auto"}}, 5).ratio == Ratio.AUTO
    # no lengths: the text's separators mark the passages; ratio and selector still apply
    assert blend_spec({BLEND_PARAM: {"ratio": 0.3, "selector": "sinks"}}, 5) == BlendSpec((), Ratio(0.3), "sinks")


def test_blend_request_tokenizes_each_part_as_blend_engine_does(tokenizer):
    text = DEFAULT_SEPARATOR.join(["You answer from passages.", "Alpha is a town in Mercia.",
                                   "Beta was founded in 1200.", "Q: where is Alpha?"])
    ids, params = blend_request(tokenizer, text, ratio=0.15)
    split = split_prompt(tokenizer, text)
    spec = blend_spec(params, len(ids))
    assert spec.parts(ids) == (split.prefix, split.chunks, split.query, [[] for _ in split.chunks])
    assert spec.ratio == Ratio(0.15) and spec.selector is None
    with pytest.raises(ValueError, match="no .* in the prompt"):
        blend_request(tokenizer, "no marker at all")


# -- passages marked in a prompt's text, tokenized whole (as vLLM does) --------------------------

SEP = DEFAULT_SEPARATOR


def test_a_prompt_without_two_markers_is_no_blend(tokenizer):
    assert separated_spec(tokenizer, tokenizer.encode("no marker at all"), SEP) is None
    assert separated_spec(tokenizer, tokenizer.encode(f"system{SEP}question?"), SEP) is None  # prefix + query


@pytest.mark.parametrize("text, match", [
    (f"system{SEP}passage{SEP}", "query after the last one is empty"),
])
def test_a_marked_prompt_without_a_query_is_refused_in_one_line(tokenizer, text, match):
    with pytest.raises(ValueError, match=match) as info:
        separated_spec(tokenizer, tokenizer.encode(text), SEP)
    assert "\n" not in str(info.value)


def test_ids_that_are_not_the_texts_tokenization_are_refused(tokenizer):
    parts = [tokenizer.encode(t) for t in ("You answer.", SEP, "Doc A.", SEP, "question?")]
    ids = [t for p in parts for t in p]  # each part alone: "." and "<", where the whole text has ".<"
    assert tokenizer.backend.encode(tokenizer.decode(ids), add_special_tokens=False).ids != ids
    with pytest.raises(ValueError, match="not its text's tokenization"):
        separated_spec(tokenizer, ids, SEP)


def test_separator_tokens_are_glue_and_the_last_goes_with_the_query(tokenizer):
    text = f"You answer.{SEP}Doc A is here.{SEP}\nDoc B\n{SEP}\nQ: who?"
    ids = tokenizer.encode(text)
    spec = separated_spec(tokenizer, ids, SEP)
    prefix, passages, query, glue = spec.parts(ids)
    assert prefix + [t for g, p in zip(glue, passages) for t in g + p] + query == ids
    decode = tokenizer.decode
    # ".<" straddles the first two separators: glue, so the texts lose their full stops
    assert [decode(p) for p in passages] == ["Doc A is here", "\nDoc B\n"] and decode(prefix) == "You answer"
    assert [decode(g) for g in glue] == [f".{SEP}", f".{SEP}"] and decode(query) == f"{SEP}\nQ: who?"
    assert spec.cached_tokens == len(ids) - len(query) and spec.ratio is None and spec.selector is None
    # a passage at token boundaries is its own tokenization: the chunk key BlendEngine uses
    assert passages[1] == tokenizer.encode("\nDoc B\n")


def test_markers_at_the_start_and_side_by_side(tokenizer):
    text = f"{SEP}A\n{SEP}{SEP}\nB\n{SEP}\nQ"
    ids = tokenizer.encode(text)
    prefix, passages, query, glue = separated_spec(tokenizer, ids, SEP).parts(ids)
    assert prefix == [] and [tokenizer.decode(p) for p in passages] == ["A\n", "\nB\n"]
    assert [tokenizer.decode(g) for g in glue] == [SEP, SEP + SEP]  # an empty passage is dropped


def test_a_passage_has_the_same_tokens_in_every_prompt(tokenizer):
    # The bench's prompts (chat template, passages between invisible-separator markers), whole as
    # vLLM tokenizes them, with the passages in other orders and combinations: each passage has the
    # same tokens (so one chunk key) wherever it appears, and they are the ones BlendEngine cuts
    # with split_prompt(whole=True).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from musique import MUSIQUE_DEV, SEP as BENCH_SEP, prompt_text

    if not MUSIQUE_DEV.is_file():
        pytest.skip(f"MuSiQue data not found at {MUSIQUE_DEV}")
    rng = random.Random(3)
    for item in json.loads(MUSIQUE_DEV.read_text())[:6]:
        texts = [p["text"] for p in item["ctxs"]]
        seen: dict[int, list[int]] = {}
        for _ in range(3):
            chosen = rng.sample(range(len(texts)), rng.randint(2, 5))
            text = prompt_text(tokenizer, [texts[i] for i in chosen], item["question"])
            ids = tokenizer.encode(text)
            prefix, found, query, glue = separated_spec(tokenizer, ids, BENCH_SEP).parts(ids)
            assert split_prompt(tokenizer, text, BENCH_SEP, whole=True) == BlendPrompt(prefix, found, query, glue)
            assert all(tokenizer.decode(g) == BENCH_SEP for g in glue) and len(found) == len(chosen)
            for i, tokens in zip(chosen, found):
                assert seen.setdefault(i, tokens) == tokens


def test_random_marked_texts_are_cut_without_losing_a_token(tokenizer):
    # Markers anywhere (inside words, beside digits, punctuation, non-ASCII): the parts always
    # cover the prompt in order, no passage token overlaps a marker, every glue run does.
    rng = random.Random(5)
    words = ["alpha", "Beta", "12", "3.5", "naïve", "東京", "x", ".", ",", "!", "(", ")", "\n", " ", "  ", "<", "|"]
    for _ in range(200):
        pieces = [rng.choice(words) + ("" if rng.random() < 0.5 else " ") for _ in range(rng.randint(1, 30))]
        for _ in range(rng.randint(2, 5)):
            pieces.insert(rng.randint(0, len(pieces)), SEP)
        text = "".join(pieces) + rng.choice(words) + "?"
        ids = tokenizer.encode(text)
        spec = separated_spec(tokenizer, ids, SEP)
        if spec is None:
            continue
        prefix, passages, query, glue = spec.parts(ids)
        assert prefix + [t for g, p in zip(glue, passages) for t in g + p] + query == ids
        assert all(passages) and all(glue)
        assert all(SEP not in tokenizer.decode(p) for p in [prefix, *passages])
        assert all(any(c in SEP for c in tokenizer.decode(g)) for g in glue)


@pytest.mark.parametrize("spec", [
    {"lengths": list(range(1, 1_000_000)) + ["x"]},     # a million counts, one of them a string
    {"lengths": [1, 2], "ratio": "auto" * 250_000},     # a megabyte string
    {"lengths": [1, 2], "selector": "x\nKVStoreConnector: forged line"},
    {"lengths": [1, 2], **{f"k{i}": i for i in range(100_000)}},
    {"lengths": [1, 10**4000]},                         # a 4,001-digit count (JSON allows up to 4,300)
])
def test_hostile_values_make_a_short_refusal_and_a_short_log_line(spec, caplog):
    # a client's values reach the scheduler's log: repr'd (no forged lines) and cut short (a
    # million-element list is not a megabyte line); so is the request id, which a client may set
    from engine_adapter.vllm.blend import BlendRequests

    with pytest.raises(ValueError) as info:
        blend_spec({BLEND_PARAM: spec}, 10)
    assert "\n" not in str(info.value) and len(str(info.value)) < 1000
    reader = BlendRequests("", "/nonexistent", max_passages=8)
    with caplog.at_level("WARNING", logger="vllm.kvstore_connector"):
        assert reader.spec("id\nKVStoreConnector: forged" + "x" * 100_000, [1] * 20, {BLEND_PARAM: spec}) is None
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and len(record.getMessage()) < 1000


def test_hostile_ids_are_no_blend_or_a_one_line_refusal(tokenizer):
    # ids past the vocabulary, all special tokens, separator pieces glued to other tokens: never a
    # crash in the scheduler, at most a refusal it logs (the request is then a plain prompt)
    marked = tokenizer.encode(f"a{SEP}b{SEP}c")
    assert separated_spec(tokenizer, [tokenizer.vocab_size + 5, 1, 2], SEP) is None
    assert separated_spec(tokenizer, [0] * 50, SEP) is None
    with pytest.raises(ValueError, match="not its text's tokenization"):
        separated_spec(tokenizer, marked[:1] + marked[1:2] * 3 + marked, SEP)  # "<" "<" "<": not how the text tokenizes


def test_blends_that_would_cost_more_than_they_save_are_refused(tokenizer):
    # a hostile client: thousands of 1-token passages, or a prompt that is mostly separators
    many = blend_spec({BLEND_PARAM: {"lengths": [0] + [1] * 300}}, 400)
    with pytest.raises(ValueError, match="300 passages marked; at most 128"):
        check_blend_cost(many, 128)
    check_blend_cost(blend_spec({BLEND_PARAM: {"lengths": [0] + [1] * 128}}, 400), 128)
    text = "q" + f"{SEP}a" * 40 + f"{SEP}question?"
    ids = tokenizer.encode(text)
    with pytest.raises(ValueError, match="separators are .* at most 25%"):
        check_blend_cost(separated_spec(tokenizer, ids, SEP), 128)
    ordinary = tokenizer.encode(f"You answer.\n{SEP}\n" + "A long passage about towns. " * 20 + f"\n{SEP}\nQ?")
    spec = separated_spec(tokenizer, ordinary, SEP)
    assert spec is not None and len(spec.lengths) == 2
    check_blend_cost(spec, 128)  # an ordinary marked prompt passes


def test_blend_requests_are_read_once_and_failures_are_plain_prompts(tokenizer, tmp_path, caplog):
    # the scheduler's reader: parameters or markers, each request read once (it is asked at every
    # scheduling attempt), a refusal logged once, no tokenizer means no markers
    from engine_adapter.vllm.blend import BlendRequests

    folder = tmp_path / "model"
    folder.mkdir()
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    reader = BlendRequests(SEP, folder, max_passages=2)
    a, b = "Alpha is a town in Mercia, on a river. " * 4, "Beta was founded in 1200 by monks. " * 4
    marked = tokenizer.encode(f"sys\n{SEP}\n{a}\n{SEP}\n{b}\n{SEP}\nQ?")  # separators well under a quarter
    spec = reader.spec("r1", marked, None)
    assert spec is not None and len(spec.lengths) == 3 and spec.glue
    assert reader.spec("r1", marked, None) is spec
    assert reader.spec("r2", marked, {BLEND_PARAM: {"ratio": 0.3}}).ratio == Ratio(0.3)  # markers + the request's ratio
    too_many = tokenizer.encode(f"sys\n{SEP}\n{a}\n{SEP}\n{b}\n{SEP}\n{a}\n{SEP}\nQ?")
    with caplog.at_level("WARNING", logger="vllm.kvstore_connector"):
        assert reader.spec("r3", too_many, None) is None and reader.spec("r3", too_many, None) is None
    assert sum("3 passages marked" in r.message for r in caplog.records) == 1
    reader.forget("r3")
    assert reader.spec("plain", tokenizer.encode("no markers"), None) is None
    blind = BlendRequests(SEP, tmp_path / "none", max_passages=2)  # no tokenizer there: markers unread
    assert blind.spec("r1", marked, None) is None
    assert blind.spec("r4", [1, 2, 3, 4], {BLEND_PARAM: {"lengths": [1, 2]}}) == BlendSpec((1, 2))


def test_the_blend_model_is_loaded_on_the_device_of_vllms_pages(monkeypatch):
    """On a GPU the connector hands the blender its KV pages' device, and the blend model must load
    there (a CPU copy would blend on the host and cross to the GPU per request). CI has one device:
    this checks that the device reaches the loader."""
    import torch

    import engine_adapter.reference.loader
    from engine_adapter.vllm.blend import VllmBlender

    seen = {}

    def load(folder, dtype, device="cpu"):
        seen.update(folder=folder, dtype=dtype, device=device)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_adapter.reference.loader, "load_hf_folder", load)
    blender = VllmBlender("/models/m", torch.bfloat16, cache=None, namespace=None, device=torch.device("meta"))
    with pytest.raises(RuntimeError, match="stop here"):
        blender.engine()
    assert seen == {"folder": Path("/models/m"), "dtype": torch.bfloat16, "device": torch.device("meta")}
    assert VllmBlender("/models/m", torch.bfloat16, cache=None, namespace=None).device == torch.device("cpu")


def test_a_vllm_model_the_view_cannot_serve_falls_back_to_a_copy(monkeypatch, caplog):
    """With ``vllm_model`` the blend computes with vLLM's layers; a model that is not found, or not
    a Llama-shaped one with this worker's heads, loads the copy instead, saying why in one line."""
    import torch
    from torch import nn

    import engine_adapter.reference.loader
    from engine_adapter.reference.loader import gguf_config, find_smollm2_gguf
    from engine_adapter.vllm.blend import VllmBlender

    config, tokenizer = gguf_config(find_smollm2_gguf())
    monkeypatch.setattr(engine_adapter.reference.loader, "hf_folder_config", lambda folder: (config, tokenizer, []))
    loads = []

    def load(folder, dtype, device="cpu"):
        loads.append(folder)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_adapter.reference.loader, "load_hf_folder", load)
    for found, reason in [(None, "not found"), (nn.Linear(2, 2), "has no model.embed_tokens")]:
        blender = VllmBlender("/models/m", torch.bfloat16, cache=None, namespace=None, vllm_model=lambda: found)
        with caplog.at_level("WARNING", logger="vllm.kvstore_connector"), pytest.raises(RuntimeError, match="stop"):
            blender._model()
        assert reason in caplog.text and "second copy of the weights" in caplog.text
        caplog.clear()
    assert len(loads) == 2


def test_the_view_refuses_a_worker_with_other_heads_or_layers():
    """Tensor or pipeline parallel workers hold a part of the model: the view says so, not a wrong blend."""
    from types import SimpleNamespace

    from torch import nn

    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
    from engine_adapter.vllm.model_view import view_problem

    config = gguf_config(find_smollm2_gguf())[0]

    def model(layers, heads):
        attn = SimpleNamespace(qkv_proj=nn.Identity(), o_proj=nn.Identity(), num_heads=heads,
                               num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
        layer = SimpleNamespace(self_attn=attn, input_layernorm=None, post_attention_layernorm=None, mlp=None)
        return SimpleNamespace(model=SimpleNamespace(embed_tokens=None, norm=None, layers=[layer] * layers))

    assert view_problem(model(config.num_layers, config.num_heads), config) is None
    assert "tensor parallel" in view_problem(model(config.num_layers, config.num_heads // 3), config)
    assert "pipeline parallel" in view_problem(model(config.num_layers // 2, config.num_heads), config)


class CPUAttentionBackendImpl:
    """A stand-in for vLLM's CPU attention backend (the view reads its class name and settings)."""
    scale, alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_cache_dtype = 0.125, None, -1, 0, None, "auto"


def fake_vllm_model(config, impl, isa: str | None = "vec"):
    """What `VllmModelView` reads of a vLLM model for its row attention: layer 0's attention layer."""
    from types import SimpleNamespace

    import torch

    attention = SimpleNamespace(impl=impl, isa=isa, kv_cache=torch.empty(1, 3, 32, 128))
    layer = SimpleNamespace(self_attn=SimpleNamespace(attn=attention))
    return SimpleNamespace(model=SimpleNamespace(layers=[layer] * config.num_layers)), attention


def test_the_view_uses_vllms_row_kernel_only_where_it_applies_and_says_which(caplog):
    """The blend's rows attend on vLLM's CPU kernel with vLLM's CPU backend, a bf16 or float32 model on
    the host; any other backend, dtype or device keeps the SDPA calls. Decided once, logged once."""
    from types import SimpleNamespace

    import torch

    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
    from engine_adapter.vllm.model_view import VllmModelView

    config = gguf_config(find_smollm2_gguf())[0]

    def view(impl, dtype=torch.bfloat16, device="cpu"):
        return VllmModelView(config, fake_vllm_model(config, impl)[0], dtype, torch.device(device))

    cases = [(view(SimpleNamespace()), "SDPA calls (backend SimpleNamespace"),
             (view(CPUAttentionBackendImpl(), dtype=torch.float16), "SDPA calls (torch.float16"),
             (view(CPUAttentionBackendImpl(), device="meta"), "SDPA calls (the model is on meta")]
    for other, line in cases:
        with caplog.at_level("INFO", logger="vllm.kvstore_connector"):
            assert other.row_attention(torch.tensor([3, 4, 9]), 12) is None
            assert other.row_attention(torch.tensor([5]), 12) is None
        assert caplog.text.count("the blend's row attention runs on") == 1 and line in caplog.text, caplog.text
        caplog.clear()
    # the kernel's own case needs vLLM: tests/test_vllm_layout.py (the kernel against float64) and
    # tests/test_vllm_blend.py (the log line of a real worker)


def test_a_row_kernel_that_fails_costs_the_blend_speed_not_the_blend(monkeypatch, caplog):
    """vLLM's kernel not yet set up: SDPA for now, asked again later. A kernel that raises when planned
    or when called (an ISA no test here ran): that layer and every later row set take the SDPA calls,
    with the same result, and one warning says why."""
    import torch

    from blend.recompute import SdpaRows
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
    from engine_adapter.vllm import model_view

    config = gguf_config(find_smollm2_gguf())[0]
    model, attention = fake_vllm_model(config, CPUAttentionBackendImpl(), isa=None)

    class Raises:
        def __init__(self, *args, when="plan"):
            if when == "plan":
                raise RuntimeError("no kernel for this ISA")

        def __call__(self, *args):
            raise RuntimeError("kernel failed mid-blend")

    rows = torch.tensor([2, 3, 7, 11])
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(config.num_heads, 4, config.head_dim, generator=generator)
    keys, values = (torch.randn(config.num_kv_heads, 14, config.head_dim, generator=generator) for _ in range(2))
    want = SdpaRows(rows, torch.float32)(0, q, keys, values)
    for when in ("plan", "call"):
        monkeypatch.setattr(model_view, "PagedRows", lambda *args, when=when: Raises(when=when))
        attention.isa = None
        view = model_view.VllmModelView(config, model, torch.float32, torch.device("cpu"))
        assert view.row_attention(rows, 12) is None and view.row_kernel is None  # not decided yet
        attention.isa = "vec"
        with caplog.at_level("WARNING", logger="vllm.kvstore_connector"):
            chosen = view.row_attention(rows, 12)
            if when == "call":
                assert torch.equal(chosen(0, q, keys, values), want)
                assert torch.equal(chosen(1, q, keys, values), want)
            else:
                assert chosen is None
        assert view.row_kernel.startswith("vLLM's kernel failed") and caplog.text.count("falls back to SDPA") == 1
        assert view.row_attention(rows, 12) is None  # every later row set
        caplog.clear()
