"""bench/serving.py: the workload generator, the summary and target arithmetic, and (where vLLM is
importable: CI's .venv-vllm step) one end-to-end ``--quick`` run against real vLLM servers.

The unit tests run under the main Python: nothing here imports vLLM or httpx at module level.
Most use a word-level stand-in tokenizer (crc32 of each word) on the bundled MuSiQue sample, so
they need neither the model file nor ../shared.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import serving  # noqa: E402
from serving_report import Target, cache_figures, evaluate_targets, percentile, summarize, sustains  # noqa: E402
from serving_workload import (  # noqa: E402
    CHUNK_TOKENS, Corpus, Turn, Workload, WorkloadConfig, arrivals, build_workload, bundled_corpus, chunks_of,
    interleave_stride, load_corpus, poisson_arrivals, staggered)

BUNDLED = ROOT / "engine_adapter" / "data" / "musique_sample.json"


def words(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 49_000 for w in text.split()]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return bundled_corpus()


def config(mode: str = "multi-round", **overrides) -> WorkloadConfig:
    return WorkloadConfig(**{"mode": mode, "users": 5, "rounds": 3, "context_tokens": 600, "system_tokens": 40,
                             "answer_tokens": 8, "seed": 3, **overrides})


def full_prompts(workload: Workload) -> list[tuple[int, ...]]:
    return [tuple(workload.prompt(t, workload.placeholder_answers)) for t in workload.turns]


# -- workload ---------------------------------------------------------------------------------


def test_bundled_sample_parses_from_the_package_and_as_a_file():
    corpus = bundled_corpus()
    assert len(corpus.documents) == 1 and len(corpus.documents[0]) > 10_000 and corpus.questions
    assert load_corpus(BUNDLED).documents == corpus.documents


@pytest.mark.parametrize("mode", ["multi-round", "long-doc", "no-reuse"])
def test_workload_is_seeded(corpus, mode):
    one, two = build_workload(config(mode), corpus, words), build_workload(config(mode), corpus, words)
    assert one == two
    other = build_workload(config(mode, seed=4), corpus, words)
    assert [t.head for t in other.turns] != [t.head for t in one.turns] or \
           [t.question for t in other.turns] != [t.question for t in one.turns]


def test_config_rejects_unknown_mode_and_zero_users():
    with pytest.raises(ValueError, match="unknown mode"):
        WorkloadConfig(mode="chat")
    with pytest.raises(ValueError, match="users"):
        WorkloadConfig(users=0)


def test_poisson_arrivals_have_the_offered_mean_rate():
    for qps in (0.5, 2.0):
        times = poisson_arrivals(20_000, qps, seed=1)
        assert times[0] == 0.0 and times == sorted(times)
        rate = (len(times) - 1) / times[-1]
        assert rate == pytest.approx(qps, rel=0.03)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential
    assert poisson_arrivals(10, 1.0, 5) == poisson_arrivals(10, 1.0, 5) != poisson_arrivals(10, 1.0, 6)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, 1)


def test_multi_round_interleaves_users_and_chains_rounds(corpus):
    workload = build_workload(config(), corpus, words)
    cfg = workload.config
    assert len(workload.turns) == cfg.users * cfg.rounds
    stride = interleave_stride(cfg.users)
    assert stride == 3 and [t.round for t in workload.turns[:stride]] == [1] * stride
    firsts = [i for i, t in enumerate(workload.turns) if t.round == 1]
    assert firsts[-1] > len(workload.turns) // 3  # first rounds are spread, not all up front
    for user in range(cfg.users):
        mine = [t for t in workload.turns if t.user == user]
        assert [t.round for t in mine] == list(range(1, cfg.rounds + 1))
        for before, after in zip(mine, mine[1:]):
            assert after.follows == before.index
            others = {t.user for t in workload.turns[before.index + 1 : after.index]}
            assert user not in others and len(others) >= stride - 1  # other users' requests in between
    prompts = {t.index: p for t, p in zip(workload.turns, full_prompts(workload))}
    for t in workload.turns:
        assert prompts[t.index][: len(workload.system)] == workload.system
        if t.follows is not None:  # a round's prompt extends the user's previous one
            earlier = prompts[t.follows]
            assert prompts[t.index][: len(earlier)] == earlier
    assert workload.prompt_tokens(workload.turns[-1]) == len(prompts[workload.turns[-1].index])


def test_staggered_order_keeps_rounds_apart_for_any_user_count():
    for users in range(1, 12):
        order = staggered(list(range(users)), 3)
        assert sorted(order) == sorted((u, r) for u in range(users) for r in (1, 2, 3))
        stride = interleave_stride(users)
        for u in range(users):
            at = [order.index((u, r)) for r in (1, 2, 3)]
            assert at == sorted(at) and all(b - a >= stride for a, b in zip(at, at[1:]))
    assert staggered(["a", "b"], 2) == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_long_doc_asks_each_document_rounds_times_without_history(corpus):
    workload = build_workload(config("long-doc"), corpus, words)
    heads = {}
    for t in workload.turns:
        heads.setdefault(t.user, set()).add(t.head)
        assert t.follows is None and not t.carries_history
    assert all(len(h) == 1 for h in heads.values()) and len(heads) == workload.config.users
    for user in heads:
        assert sorted(t.round for t in workload.turns if t.user == user) == [1, 2, 3]


def test_no_reuse_prompts_share_no_chunk(corpus):
    # 15 prompts of 600 tokens from a ~3.5k-word sample: the windows overlap, so chunks are nudged apart
    workload = build_workload(config("no-reuse"), corpus, words)
    assert workload.system == ()
    seen: set[tuple[int, ...]] = set()
    for prompt in full_prompts(workload):
        pieces = chunks_of(prompt, CHUNK_TOKENS)
        assert pieces and not pieces & seen
        seen |= pieces


def test_no_reuse_with_the_real_tokenizer_shares_no_chunk():
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config

    try:
        _, tokenizer = gguf_config(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    workload = build_workload(WorkloadConfig("no-reuse", users=4, rounds=3, context_tokens=1024),
                              bundled_corpus(), tokenizer.encode)
    seen: set[tuple[int, ...]] = set()
    for prompt in full_prompts(workload):
        assert not chunks_of(prompt) & seen
        seen |= chunks_of(prompt)


def distinct_prefixes(prompts: list[tuple[int, ...]]) -> int:
    """The reference: every prefix of every prompt, counted once."""
    return len({p[:i] for p in prompts for i in range(1, len(p) + 1)})


@pytest.mark.parametrize("mode", ["multi-round", "long-doc", "no-reuse"])
def test_working_set_counts_each_distinct_prefix_once(corpus, mode):
    workload = build_workload(config(mode, context_tokens=60, system_tokens=12, users=3, rounds=2), corpus, words)
    assert workload.working_set_tokens == distinct_prefixes(full_prompts(workload))


def test_working_set_of_a_hand_built_workload():
    cfg = WorkloadConfig(users=2, rounds=2, context_tokens=1, system_tokens=2, answer_tokens=3)
    system = (1, 2)
    turns = (Turn(0, 0, 1, system + (10, 11), (90,), None, True), Turn(1, 1, 1, system + (20,), (91,), None, True),
             Turn(2, 0, 2, system + (10, 11), (92, 93), 0, True), Turn(3, 1, 2, system + (20,), (94,), 1, True))
    workload = Workload(cfg, system, turns, "hand")
    # system 2 + heads' rest (2 + 1) + questions (1 + 1 + 2 + 1) + the two carried answers (3 + 3)
    assert workload.working_set_tokens == 2 + 3 + 5 + 6
    assert workload.prompt_tokens(turns[2]) == 4 + 1 + 3 + 2
    assert workload.max_prompt_tokens == 10


def mooncake_file(tmp_path: Path, lines: list[tuple[int, int, list[int]]]) -> str:
    """A Mooncake-format trace of (timestamp ms, input_length, hash_ids) lines."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 9, "hash_ids": ids}) + "\n"
                            for t, n, ids in lines))
    return str(path)


def test_trace_mode_maps_each_hash_id_to_one_run_of_tokens(tmp_path, corpus):
    trace = mooncake_file(tmp_path, [
        (0, 1024 + 100, [0, 1, 2]),          # two full blocks and a 100-token tail
        (1000, 512 * 2, [0, 3]),             # shares block 0 only: a new conversation
        (1000, 512 * 3, [0, 1, 4]),          # continues the first one
        (4000, 512 * 40, list(range(100, 140))),  # longer than the context: cut
    ])
    cfg = WorkloadConfig("trace", answer_tokens=8, trace=trace, trace_block_tokens=16, trace_max_tokens=16 * 10 + 8)
    workload = build_workload(cfg, corpus, words)
    prompts = full_prompts(workload)
    assert [len(p) for p in prompts] == [16 + 16 + 4, 32, 48, 16 * 10]  # tail: ceil(100 x 16 / 512) = 4
    assert prompts[0][:16] == prompts[1][:16] == prompts[2][:16]        # id 0 everywhere
    assert prompts[2][:32] == prompts[0][:32] and prompts[1][16:32] != prompts[0][16:32]
    assert prompts[2][32:36] != prompts[0][32:36]                       # id 4 is not id 2
    assert [t.round for t in workload.turns] == [1, 1, 2, 1]            # "r>=2": continues an earlier request
    assert all(t.follows is None and not t.carries_history for t in workload.turns)
    assert full_prompts(build_workload(cfg, corpus, words)) == prompts  # seeded: every engine gets the same
    assert workload.working_set_tokens == 16 + 16 + 4 + 16 + 16 + 16 * 10  # ids 0, 1, 2 (a tail), 3, 4; the cut chain


def test_trace_mode_scales_timestamps_to_the_offered_rate(tmp_path, corpus):
    trace = mooncake_file(tmp_path, [(0, 600, [0, 1]), (3000, 600, [0, 2]), (3000, 600, [0, 3]), (9000, 600, [0, 4])])
    workload = build_workload(WorkloadConfig("trace", trace=trace), corpus, words)
    sent = arrivals(workload, 0.5, seed=0)
    assert sent == pytest.approx([0.0, 2.0, 2.0, 6.0])  # 4 requests over (4 - 1) / 0.5 s, in the trace's shape
    records = [{"error": None, "ttft_s": 0.1, "round": 1, "itl_s": [], "end_s": a + 1, "sent_s": a, "arrival_s": a,
                "prompt_tokens": 1, "cached_tokens": 0, "output_tokens": 1} for a in sent]
    assert summarize(records, 0.5)["offered_rps"] == pytest.approx(0.5)
    same_time = build_workload(WorkloadConfig("trace", trace=mooncake_file(tmp_path, [(5, 600, [0, 1])] * 3)),
                               corpus, words)
    assert arrivals(same_time, 2.0, seed=0) == [0.0, 0.5, 1.0]
    assert arrivals(build_workload(config("long-doc"), corpus, words), 1.0, 7) == poisson_arrivals(15, 1.0, 7)


def test_trace_mode_samples_whole_conversations_and_takes_the_first_requests(tmp_path, corpus):
    trace = mooncake_file(tmp_path, [(i, 1024, [0, second]) for i, second in enumerate([4, 5, 8, 4, 12, 8])])
    sampled = build_workload(WorkloadConfig("trace", trace=trace, trace_sample=4), corpus, words)
    assert len(sampled.turns) == 5 and [t.round for t in sampled.turns] == [1, 1, 2, 1, 2]
    first = build_workload(WorkloadConfig("trace", trace=trace, trace_sample=4, trace_requests=2), corpus, words)
    assert full_prompts(first) == full_prompts(sampled)[:2]
    with pytest.raises(ValueError, match="trace file"):
        WorkloadConfig("trace")
    with pytest.raises(ValueError, match="only trace mode"):
        WorkloadConfig("multi-round", trace=trace)
    with pytest.raises(SystemExit):
        serving.parse_args(["--mode", "trace"])
    args = serving.parse_args(["--mode", "trace", "--trace", trace, "--requests", "3", "--trace-sample", "4"])
    assert (args.workload_config.trace_requests, args.workload_config.trace_sample) == (3, 4)


# -- summaries and targets --------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile(list(range(1, 101)), 90) == pytest.approx(90.1)


def record(turn: int, round_: int, sent: float, ttft: float, end: float, arrival: float | None = None,
           error: str | None = None, prompt: int = 1000, cached: int = 0) -> dict:
    return {"turn": turn, "user": turn, "round": round_, "arrival_s": sent if arrival is None else arrival,
            "sent_s": sent, "ttft_s": None if error else ttft, "end_s": end, "itl_s": [] if error else [0.1, 0.2],
            "output_tokens": 0 if error else 3, "prompt_tokens": prompt, "cached_tokens": cached, "error": error}


def test_summary_separates_later_rounds_and_drops_failures():
    records = [record(0, 1, 0.0, 2.0, 2.5), record(1, 1, 1.0, 3.0, 4.5), record(2, 2, 2.0, 0.2, 2.6, cached=900),
               record(3, 2, 3.0, 0.4, 4.0, arrival=2.5, cached=900), record(4, 2, 3.5, 0.0, 9.0, error="HTTP 500")]
    s = summarize(records, qps=1.0)
    assert (s["requests"], s["completed"], s["errors"]) == (5, 4, 1)
    assert s["ttft_p50_s"] == pytest.approx(1.2)  # 0.2 0.4 2.0 3.0
    assert s["ttft_rounds2_p50_s"] == pytest.approx(0.3) and s["rounds2_requests"] == 2
    assert s["itl_p50_s"] == pytest.approx(0.15)
    assert s["completed_rps"] == pytest.approx(4 / 4.5)  # first send 0.0, last end 4.5
    assert s["output_tps"] == pytest.approx(12 / 4.5)
    assert s["offered_rps"] == pytest.approx(5 / (3.5 + 1.0))
    assert s["cached_ratio"] == pytest.approx(1800 / 4000)
    assert s["held_s_max"] == pytest.approx(0.5)


def test_cache_figures_are_deltas_over_the_workload():
    label = {"engine": "0", "model_name": "smollm2"}
    local, external = "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"
    vllm_before = [(local, label, 128.0), (external, label, 0.0)]
    vllm_after = [(local, label, 1128.0), (external, label, 3000.0), ("vllm:num_preemptions_total", label, 2.0)]
    daemon_before = [("kvstore_bytes_in_total", {"tier": "cpu"}, 10e6), ("kvstore_lookup_hits_total", {}, 4.0)]
    daemon_after = [("kvstore_bytes_in_total", {"tier": "cpu"}, 60e6),
                    ("kvstore_bytes_in_total", {"tier": "disk"}, 50e6),
                    ("kvstore_bytes_out_total", {"tier": "cpu"}, 30e6), ("kvstore_lookup_hits_total", {}, 16.0)]
    trace = [{"blocks": [{"tokens": 256}, {"tokens": 256}, {"tokens": 128}], "hits": 2, "lookup_s": 0.001},
             {"blocks": [{"tokens": 256}], "hits": 0, "lookup_s": 0.003}]
    f = cache_figures(vllm_before, vllm_after, daemon_before, daemon_after, trace, prompt_tokens=10_000)
    assert (f["vllm_hit_tokens"], f["kvstore_hit_tokens"], f["preemptions"]) == (1000.0, 3000.0, 2.0)
    assert (f["vllm_hit_ratio"], f["kvstore_hit_ratio"]) == (0.1, 0.3)
    assert f["kvstore_trace_hit_tokens"] == 512 and f["daemon_lookup_hit_keys"] == 12.0
    assert f["bytes_in_by_tier"] == {"cpu": 50e6, "disk": 50e6} and f["bytes_in_mb"] == pytest.approx(100.0)
    assert f["bytes_out_mb"] == pytest.approx(30.0)
    assert f["lookup_p50_s"] == pytest.approx(0.002) and f["lookups"] == 2
    alone = cache_figures(vllm_before, vllm_after, None, None, [], prompt_tokens=10_000)
    assert alone["bytes_in_mb"] is None and alone["kvstore_trace_hit_tokens"] is None and alone["lookup_p50_s"] is None


def point(ttft: float, rps: float, offered: float) -> dict:
    return {"ttft_p50_s": ttft, "completed_rps": rps, "offered_rps": offered}


def test_sustains_needs_both_the_rate_and_the_ttft_bound():
    assert sustains(point(2.0, 0.95, 1.0), cold_ttft_s=1.0, sustain_factor=3.0)
    assert not sustains(point(2.0, 0.85, 1.0), 1.0, 3.0)  # falls behind
    assert not sustains(point(3.5, 1.0, 1.0), 1.0, 3.0)  # queues


def test_targets_at_the_sustained_and_the_saturated_points():
    table = {"vllm": {0.25: point(2.0, 0.25, 0.25), 0.5: point(9.0, 0.3, 0.5), 1.0: point(30.0, 0.3, 1.0)},
             "kvstore-cpu": {0.25: point(0.5, 0.25, 0.25), 0.5: point(0.6, 0.5, 0.5), 1.0: point(2.0, 0.6, 1.0)},
             "resident": {0.25: point(0.4, 0.25, 0.25), 0.5: point(0.5, 0.5, 0.5), 1.0: point(0.9, 0.9, 1.0)}}
    found = {t.name: t for t in evaluate_targets(table, "multi-round", 1.0, 3.0, {"kvstore-cpu": True})}
    ttft = found["kvstore-cpu:ttft_vs_vllm"]
    assert ttft.value == pytest.approx(4.0) and ttft.met and "QPS 0.25" in ttft.detail
    throughput = found["kvstore-cpu:throughput_vs_vllm"]  # saturated at 0.5 and 1: the higher
    assert throughput.value == pytest.approx(0.6 / 0.3) and throughput.met and "QPS 1," in throughput.detail
    resident = found["kvstore-cpu:ttft_vs_resident"]  # resident sustains all three: the worst is at 1
    assert resident.value == pytest.approx(2.0 / 0.9) and not resident.met and "at QPS 1;" in resident.detail
    assert resident.detail.endswith("0.25: 1.25x, 0.5: 1.20x, 1: 2.22x")
    assert "NOT MET" in resident.line()


def test_targets_say_what_cannot_be_measured():
    saturated = {"vllm": {1.0: point(30.0, 0.3, 1.0)}, "kvstore-disk": {1.0: point(1.0, 0.9, 1.0)}}
    found = {t.name: t for t in evaluate_targets(saturated, "multi-round", 1.0, 3.0, {"kvstore-disk": False})}
    assert found["kvstore-disk:ttft_vs_vllm"].met is None and "lower --qps" in found["kvstore-disk:ttft_vs_vllm"].detail
    assert found["kvstore-disk:throughput_vs_vllm"].met is True
    assert "kvstore-disk:ttft_vs_resident" not in found
    assert evaluate_targets({"vllm": saturated["vllm"]}, "multi-round", 1.0, 3.0, {})[0].met is None


def test_no_reuse_targets_take_the_worst_point():
    table = {"vllm": {0.5: point(2.0, 0.5, 0.5), 1.0: point(4.0, 0.4, 1.0)},
             "kvstore-cpu": {0.5: point(2.05, 0.5, 0.5), 1.0: point(4.4, 0.39, 1.0)}}
    found = {t.name: t for t in evaluate_targets(table, "no-reuse", 1.0, 3.0, {})}
    assert found["kvstore-cpu:no_reuse_throughput"].value == pytest.approx(0.39 / 0.4)
    assert found["kvstore-cpu:no_reuse_throughput"].met
    assert found["kvstore-cpu:no_reuse_ttft"].value == pytest.approx(1.1) and not found["kvstore-cpu:no_reuse_ttft"].met
    assert Target("x", "rule", None, 1.0, True, "why").as_dict()["met"] is None


def test_engine_order_alternates_over_points_and_repeats():
    order = serving.run_order(["a", "b", "c"], [0.5, 1.0], repeats=2)
    assert [e for _, _, e in order] == list("abc" "cba" "abc" "cba")
    assert [(r, q) for r, q, _ in order[:3]] == [(0, 0.5)] * 3


def test_sizes_put_vllms_cache_below_and_residents_above_the_working_set(corpus):
    workload = build_workload(config(context_tokens=1500, users=8), corpus, words)
    args = serving.parse_args(["--vllm-cache-fraction", "0.3"])
    sizes = serving.plan_sizes(workload, kv_bytes=23_040, args=args)
    page = serving.PAGE_TOKENS
    assert sizes["small_pages"] * page < sizes["working_set_tokens"]
    assert sizes["small_pages"] * page >= workload.max_prompt_tokens + workload.config.answer_tokens
    assert sizes["resident_pages"] * page >= sizes["working_set_tokens"] + workload.max_prompt_tokens
    assert sizes["max_model_len"] % page == 0 and sizes["max_model_len"] >= workload.max_prompt_tokens + 8
    assert serving.fits("kvstore-cpu", sizes) and serving.fits("kvstore-disk", sizes)
    assert sizes["disk_cpu_capacity"] < sizes["working_set_bytes"]


def test_cli_quick_and_bad_flags():
    args = serving.parse_args(["--quick"])
    assert (args.users, args.rounds, args.qps_list, args.engine_list) == (2, 2, [1.0], ["vllm", "kvstore-cpu"])
    with pytest.raises(SystemExit):
        serving.parse_args(["--engines", "vllm,sglang"])
    with pytest.raises(SystemExit):
        serving.parse_args(["--qps", "0"])


# -- end to end (vLLM) ------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_run_reports_every_field():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here; CI runs this from .venv-vllm (see .ci/run)")
    out = Path(tempfile.mkdtemp(prefix="kvs-serving-")) / "quick.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {r["engine"] for r in result["runs"]} == {"vllm", "kvstore-cpu"}
    for run in result["runs"]:
        assert run["startup_s"] > 0 and run["probe_ttft_s"] > 0
        assert len(run["records"]) == 4 and all(r["error"] is None for r in run["records"])
        for r in run["records"]:
            assert r["output_tokens"] == 8 and len(r["itl_s"]) == 7 and r["ttft_s"] > 0
    for engine, points in result["summary"].items():
        s = points["1"]
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_rounds2_p50_s", "itl_p50_s", "itl_p99_s",
                    "completed_rps", "output_tps", "vllm_hit_ratio", "kvstore_hit_ratio"):
            assert s[key] is not None and not math.isnan(s[key]), (engine, key)
    kv = result["summary"]["kvstore-cpu"]["1"]
    assert kv["ttft_rounds2_p50_s"] > 0 and kv["kvstore_hit_ratio"] > 0 and kv["bytes_in_mb"] > 0
    assert result["summary"]["vllm"]["1"]["kvstore_hit_ratio"] == 0
    assert result["targets"] and "TTFT" in proc.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_trace_run_replays_a_small_trace_through_vllm_and_kvstore(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here; CI runs this from .venv-vllm (see .ci/run)")
    trace = mooncake_file(tmp_path, [(0, 1500, [0, 1, 2]), (500, 900, [0, 3]), (2000, 2000, [0, 1, 2, 4])])
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--mode", "trace", "--trace", trace,
                           "--trace-block-tokens", "128", "--engines", "kvstore-cpu", "--qps", "1",
                           "--answer-tokens", "4", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert [r["error"] for r in run["records"]] == [None] * 3
    assert [r["prompt_tokens"] for r in run["records"]] == [128 * 2 + 119, 128 + 97, 128 * 3 + 116]
    assert [r["round"] for r in run["records"]] == [1, 1, 2]
    assert result["workload"]["requests"] == 3 and "trace" in proc.stdout


def test_the_bench_reads_the_connectors_settings_where_they_are_defined():
    """The bench passes only settings the connector accepts (an unknown one fails vLLM's start) and
    reports the Lookup cost only when the connector writes a trace: the keys are read from
    ConnectorSettings' source, which moved to engine_adapter/vllm/settings.py (issue #58); read
    from connector.py they were none, and every run since printed "no per-request Lookup cost"."""
    import serving_engines

    assert {"address", "trace_file", "lease_s"} <= serving_engines.connector_settings()
