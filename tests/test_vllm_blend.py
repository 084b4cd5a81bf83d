"""CacheBlend inside vLLM (issue #16): a real vLLM CPU process, a real daemon, the reference engine.

Runs where vLLM is importable (CI's vLLM step, see .ci/run); the main suite skips it. One MuSiQue
question with three passages: vLLM's full prefill is the reference; the same prompt as a blend
request at ratio 1 must match it within bf16 tolerance, at 0.15 be closer than naive reuse (0), and
the passages vLLM computed alone and stored must be hits for ``BlendEngine``, with its first token.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here; CI runs this module from .venv-vllm (see .ci/run)",
                allow_module_level=True)

from blend.prompt import split_prompt  # noqa: E402
from engine_adapter.blend_engine import BlendEngine  # noqa: E402
from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from engine_adapter.vllm.blend import BLEND_PARAM  # noqa: E402
from engine_adapter.vllm.hf_folder import write_hf_folder  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402
from tests.test_vllm import run_vllm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from codec_blend import blend_parts  # noqa: E402
from musique import MUSIQUE_DEV, SEP, prompt_text  # noqa: E402
from vllm_rag import kl  # noqa: E402

MODES = ("full", "ratio 1 (passages computed alone)", "ratio 0.15", "naive (ratio 0)", "bad parameters",
         "marked text", "marked text, ratio 1", "no passage", "passages BlendEngine stored")
BLENDED = 6  # requests of MODES that the worker blends (not full, bad parameters, no passage)


@pytest.fixture(scope="module")
def blend_case():
    from engine_adapter.reference.loader import load_hf_folder

    folder = write_hf_folder(Path(tempfile.gettempdir()) / "kvstore-test-hf-v1", dtype="bfloat16")
    model, tokenizer = load_hf_folder(folder, dtype=torch.bfloat16)
    data = MUSIQUE_DEV if MUSIQUE_DEV.is_file() else None
    if data is None:
        pytest.skip(f"MuSiQue data not found at {MUSIQUE_DEV}")
    prompt = blend_parts(tokenizer, data, 1)  # question 1's ten passages, as the codec bench cuts them
    chosen, theirs = [0, 1, 2], [6, 7, 8]  # theirs: stored by BlendEngine before vLLM starts
    ids = prompt.ids(chosen)
    lengths = [len(prompt.prefix), *(len(prompt.chunks[i]) for i in chosen)]

    def blend(ratio, passages=chosen) -> dict:
        counts = [len(prompt.prefix), *(len(prompt.chunks[i]) for i in passages)]
        return {"prompt_token_ids": prompt.ids(passages),
                "kv_transfer_params": {BLEND_PARAM: {"lengths": counts, "ratio": ratio}}}

    bad = {"prompt_token_ids": ids, "kv_transfer_params": {BLEND_PARAM: {"lengths": [len(ids)]}}}
    # the same question as text, passages marked with the bench's separator, tokenized by vLLM (a
    # passage not seen before: the other passages of the question)
    item = json.loads(data.read_text())[1]
    text = prompt_text(tokenizer, [item["ctxs"][i]["text"] for i in (3, 4, 5)], item["question"])
    marked = {"prompt": text}
    one = {"prompt": prompt_text(tokenizer, [], item["question"])}  # markers side by side, no passage between
    extra = ("--kv-extra", json.dumps({"blend_separator": SEP}))
    work = Path(tempfile.mkdtemp(prefix="kvs-vllm-blend-"))
    daemon = DaemonProcess.in_folder(work / "d", cpu_capacity="512MiB", disk_path="")
    try:
        with KVStoreClient(daemon.address) as client:  # the reverse direction: BlendEngine stores first
            stored = BlendEngine(model, tokenizer, client).generate(
                prompt.prefix, [prompt.chunks[i] for i in theirs], prompt.query, max_new_tokens=1, ratio=0.15)
            assert prompt.prefix and stored.computed_segments == 4 and stored.store_done.wait(60)
        run = run_vllm(folder, work, "blend", [ids, blend(1.0), blend(0.15), blend(0.0), bad, marked,
                                               {**marked, "kv_transfer_params": {BLEND_PARAM: {"ratio": 1.0}}}, one,
                                               blend(0.15, theirs)],
                       daemon.address, new_tokens=4, args=("--no-prefix-caching", "--logprobs", *extra))
        # no daemon: every request is vLLM's own full prefill (the reference for the marked text)
        down = run_vllm(folder, work, "down", [blend(0.15), marked], f"unix:{work / 'none.sock'}", new_tokens=4,
                        args=("--no-prefix-caching", "--logprobs", *extra))
        with KVStoreClient(daemon.address) as client:
            engine = BlendEngine(model, tokenizer, client)
            reference = engine.generate(prompt.prefix, [prompt.chunks[i] for i in chosen], prompt.query,
                                        max_new_tokens=1, ratio=0.15, store=False)
            naive = engine.generate(prompt.prefix, [prompt.chunks[i] for i in chosen], prompt.query,
                                    max_new_tokens=1, ratio=0.0, store=False)
            whole = split_prompt(tokenizer, text, SEP, whole=True)
            reference_marked = engine.generate(whole.prefix, whole.chunks, whole.query, max_new_tokens=1,
                                               ratio=0.15, store=False, glue=whole.glue)
        yield {"outputs": dict(zip(MODES, run["outputs"])), "log": run["log"], "down": down,
               "reference": reference, "naive": naive, "cached": sum(lengths), "whole": whole,
               "stored": stored, "theirs_cached": len(prompt.ids(theirs)) - len(prompt.query),
               "reference_marked": reference_marked}
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_ratio_one_is_vllms_full_prefill(blend_case):
    out = blend_case["outputs"]
    full, exact = out["full"], out["ratio 1 (passages computed alone)"]
    assert exact["token_ids"][0] == full["token_ids"][0]
    assert kl(full["first_logprobs"], exact["first_logprobs"]) < 0.02  # bf16 tolerance (measured 0.001)


def test_the_blend_computes_with_vllms_own_layers(blend_case):
    # no second copy of the weights: the blends above (ratio 1 = vLLM's full prefill) ran on vLLM's
    # modules through engine_adapter/vllm/model_view.py
    assert "blend computes with vLLM's own layers" in blend_case["log"]
    assert "second copy of the weights" not in blend_case["log"]
    # and the recomputed rows' attention on vLLM's CPU attention kernel (engine_adapter/vllm/row_attention.py)
    assert "the blend's row attention runs on vLLM's CPU attention kernel" in blend_case["log"]


def test_blend_reports_every_token_before_the_query_as_cached(blend_case):
    out = blend_case["outputs"]
    for mode in MODES[1:4]:
        assert out[mode]["num_cached_tokens"] == blend_case["cached"], mode
    assert f"blended {BLENDED} requests" in blend_case["log"]


def test_blend_at_0_15_is_closer_to_full_prefill_than_naive_reuse(blend_case):
    out = blend_case["outputs"]
    full = out["full"]["first_logprobs"]
    assert kl(full, out["ratio 0.15"]["first_logprobs"]) < kl(full, out["naive (ratio 0)"]["first_logprobs"])


def test_passages_vllm_stored_are_hits_for_blend_engine_with_its_first_token(blend_case):
    reference = blend_case["reference"]
    assert reference.computed_segments == 0  # vLLM computed them alone and stored them
    assert reference.tokens[0] == blend_case["outputs"]["ratio 0.15"]["token_ids"][0]


def test_the_same_blend_in_vllm_and_blend_engine_gives_close_logits(blend_case):
    # the same request, model, dtype, selector and ratio through both engines: the same first token
    # (above) and the same distribution up to their bf16 kernels' rounding (vLLM's CPU attention and
    # oneDNN linears against torch's), which may swap a token at the edge of the selection; at ratio
    # 0 both are naive reuse
    out = blend_case["outputs"]
    for mode, reference in (("ratio 0.15", "reference"), ("naive (ratio 0)", "naive")):
        engine = blend_case[reference]
        assert engine.tokens[0] == out[mode]["token_ids"][0], mode
        # measured 0.0014 (r = 0.15, torch's query pass in both) and 0.0127 (its C kernel in both,
        # kernels/query_probs.c, where the engines' selections differ by a token: in one engine the
        # kernel against torch's pass moved this KL by up to 0.0083 on MuSiQue questions 0-5), 0.0016
        # (r = 0); against 0.06 and 0.33 from vLLM's full prefill
        assert kl(engine.first_logits, out[mode]["first_logprobs"]) < 0.025, mode


def test_passages_blend_engine_stored_are_hits_for_vllm(blend_case):
    lines = re.findall(r"blended request \S+: (\d+) of (\d+) segments from the cache", blend_case["log"])
    assert len(lines) == BLENDED
    # ratio 1, the first blend: its three passages computed alone, the prefix BlendEngine stored found
    assert lines[0] == ("1", "4")
    assert lines[-1] == ("4", "4")  # BlendEngine's prefix and passages, every one found by vLLM's worker
    out = blend_case["outputs"]["passages BlendEngine stored"]
    assert out["num_cached_tokens"] == blend_case["theirs_cached"]
    assert out["token_ids"][0] == blend_case["stored"].tokens[0]


def test_bad_parameters_and_a_down_daemon_still_answer(blend_case):
    out = blend_case["outputs"]
    assert out["bad parameters"]["token_ids"][0] == out["full"]["token_ids"][0]
    assert "served without blending" in blend_case["log"]
    down = blend_case["down"]
    assert down["outputs"][0]["token_ids"][0] == out["full"]["token_ids"][0]
    # served as plain prompts, not blended with every passage computed alone
    assert [o["num_cached_tokens"] for o in down["outputs"]] == [0, 0] and "blended 0 requests" in down["log"]


def test_passages_marked_in_the_text_are_blended(blend_case):
    # vLLM tokenized the text; the connector found the separators (glue), blended the passages and
    # reported every token before the query's as cached: at ratio 1 that is vLLM's full prefill of
    # the same text, at the default ratio the reference engine's blend of the same cut.
    out, whole = blend_case["outputs"], blend_case["whole"]
    full = blend_case["down"]["outputs"][1]
    marked, exact = out["marked text"], out["marked text, ratio 1"]
    assert marked["prompt_token_ids"] == whole.ids == full["prompt_token_ids"]
    assert marked["num_cached_tokens"] == len(whole.ids) - len(whole.query) == exact["num_cached_tokens"]
    assert exact["token_ids"][0] == full["token_ids"][0]
    assert kl(full["first_logprobs"], exact["first_logprobs"]) < 0.02  # bf16 tolerance
    assert kl(full["first_logprobs"], marked["first_logprobs"]) < 0.5
    reference = blend_case["reference_marked"]
    assert reference.computed_segments == 0  # vLLM stored the passages under the keys BlendEngine cuts
    assert reference.tokens[0] == marked["token_ids"][0]


def test_markers_without_a_passage_are_a_plain_prompt(blend_case):
    one = blend_case["outputs"]["no passage"]
    assert one["num_cached_tokens"] == 0 and one["token_ids"]
