"""Serving benchmark: many users with long contexts asking rounds of questions at a given QPS,
against real vLLM OpenAI-compatible servers whose own KV cache is smaller than the working set,
with clients streaming, so TTFT and inter-token latency are what a user sees. Modelled on LMCache's
multi-round QA benchmark (issue #41).

    .venv-vllm/bin/python bench/serving.py [--engines vllm,kvstore-cpu,kvstore-disk,resident]
        [--qps 0.3,0.6,1.2] [--mode multi-round|long-doc|no-reuse] [--json out.json] [--plot out.png]
    .venv-vllm/bin/python bench/serving.py --quick      # 2 users, 2 rounds, 1 QPS, 2 engines
    .venv-vllm/bin/python bench/serving.py --mode trace --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \
        [--trace-sample 40] [--requests 40] [--trace-block-tokens 32] [--trace-max-tokens 8192]

Engines, each run a fresh vLLM server (and daemon) on the same cores (bench/vllm_ttft.py vllm_env):

    vllm          vLLM alone, its KV cache a fraction of the working set (--vllm-cache-fraction)
    kvstore-cpu   the same small cache + a kvstore daemon with a CPU tier that holds everything
    kvstore-disk  the same + CPU and disk tiers, the CPU tier a fraction of the working set
    resident      vLLM alone with a cache that holds the whole working set (the bound)

The workload (bench/serving_workload.py, seeded, from MuSiQue's dev set when ../shared has it,
else the bundled sample): a shared system prompt, a long context per user, R rounds per user whose
prompt carries the earlier questions and the answers vLLM streamed (``max_tokens`` = answer
tokens, greedy, ``ignore_eos``); round r+1 is sent once round r has finished; arrivals are
Poisson at the offered QPS. Round 1 is cold for every engine and is in "all requests"; "r>=2"
reports the later rounds apart. Each server first gets one probe request (a context-sized prompt
sharing nothing with the workload; its TTFT is the uncontended cold prefill).

Trace mode replays a Mooncake-format trace's requests instead (bench/serving_workload.py, "trace":
each hash_id a fixed run of synthetic tokens, 512-token blocks scaled to --trace-block-tokens, chains
cut at --trace-max-tokens, the trace's timestamps scaled to each offered QPS); "r>=2" is then the
requests that continue an earlier one of the replay, and the probe prompt is the median prompt's length.

Per engine and QPS: TTFT p50/p90/p99, ITL p50/p99, completed requests/s and output tokens/s,
vLLM's own prefix-cache hits and kvstore's (vLLM's /metrics: ``vllm:prefix_cache_hits`` and
``vllm:external_prefix_cache_hits``, tokens, over the prompt tokens sent), block bytes in and out
of each daemon tier (its /metrics), and the connector's per-request Lookup cost from its trace
file when the connector writes one (``--trace-out DIR`` keeps those files: bench/cache_policy.py's
input). vLLM 0.32 reports prefix-cache hits per request only as ``usage.prompt_tokens_details.
cached_tokens`` (with ``--enable-prompt-tokens-details``), its own and the connector's together;
the split is in /metrics. Targets (issue #41; definitions in bench/serving_report.py) are printed
as ratios measured in the same run, met or not. Engines run in alternating order across QPS
points and repeats.

Sizes: the defaults (8 users x 3 rounds, 1k-token contexts, QPS 0.3 to 1.2) are what this
project's 2-core VM runs in about 20 minutes, each vLLM server taking 25-45 s to start; --quick
takes about 1.5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving_engines import (  # noqa: E402
    GiB, PAGE_TOKENS, ServerSpec, VllmServer, connector_settings, free_port, kv_bytes_per_token, play, probe,
    read_trace, scrape, transfer_config)
from serving_report import (  # noqa: E402
    KVSTORE_ENGINES, cache_figures, evaluate_targets, median_summaries, summarize, sustains)
from serving_workload import (  # noqa: E402
    MODES, WorkloadConfig, Workload, arrivals, build_workload, load_corpus)

ENGINES = ("vllm", "kvstore-cpu", "kvstore-disk", "resident")
QUICK = {"users": 2, "rounds": 2, "context_tokens": 1024, "answer_tokens": 8, "qps": "1",
         "engines": "vllm,kvstore-cpu"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="multi-round", choices=MODES)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of %(default)s")
    p.add_argument("--qps", default="0.3,0.6,1.2", help="offered request rates, comma list (default %(default)s)")
    p.add_argument("--users", type=int, default=8, help="users (documents in long-doc; default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per user (default %(default)s)")
    p.add_argument("--context-tokens", type=int, default=1024, help="per-user context (default %(default)s)")
    p.add_argument("--system-tokens", type=int, default=128, help="shared system prompt (default %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=16, help="max_tokens of each request (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="fresh servers per engine and QPS (default 1)")
    p.add_argument("--trace", metavar="FILE", default="", help="trace mode: a Mooncake-format JSON-lines trace")
    p.add_argument("--trace-block-tokens", type=int, default=32,
                   help="trace mode: tokens of one of the trace's 512-token blocks (default %(default)s)")
    p.add_argument("--trace-max-tokens", type=int, default=8192,
                   help="trace mode: prompt + answer at most, chains cut there "
                        "(default %(default)s, the model's context)")
    p.add_argument("--trace-sample", type=int, default=1,
                   help="trace mode: one conversation in N, by its second block's id (default %(default)s: all)")
    p.add_argument("--requests", type=int, default=0,
                   help="trace mode: the first N requests (after --trace-sample; default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="MuSiQue JSON list (default: ../shared/data/musique/dev.json if "
                                                "present, else the bundled sample)")
    p.add_argument("--vllm-cache-fraction", type=float, default=0.33,
                   help="vLLM's own KV cache as a fraction of the working set, for vllm and kvstore-* "
                        "(at least one longest request; default %(default)s)")
    p.add_argument("--disk-cpu-fraction", type=float, default=0.25,
                   help="kvstore-disk's CPU tier as a fraction of the working set (default %(default)s)")
    p.add_argument("--eviction", default=None, help="daemon eviction policy (lru, prefix-lru), passed on if given")
    p.add_argument("--admission", default=None, help="daemon admission policy (all, reused), passed on if given")
    p.add_argument("--sustain-factor", type=float, default=3.0,
                   help="an engine sustains a QPS if TTFT p50 <= this x vLLM alone's cold probe TTFT "
                        "(and >= 0.9x the offered rate completes; default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="per-request records, per-run and median summaries, targets")
    p.add_argument("--plot", metavar="PATH", help="TTFT p50 vs QPS per engine (needs matplotlib)")
    p.add_argument("--trace-out", metavar="DIR", help="keep the connector's trace files here (bench/cache_policy.py)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, daemon folders)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 users, 2 rounds of 8 tokens, 1k contexts, QPS 1, vllm and kvstore-cpu")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engine_list) - set(ENGINES))
    if unknown or not args.engine_list:
        p.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    try:
        args.qps_list = sorted({float(q) for q in args.qps.split(",") if q.strip()})
    except ValueError:
        p.error(f"--qps must be numbers separated by commas, got {args.qps!r}")
    if not args.qps_list or min(args.qps_list) <= 0:
        p.error("--qps needs positive rates")
    if not 0 < args.vllm_cache_fraction <= 1 or not 0 < args.disk_cpu_fraction <= 1:
        p.error("--vllm-cache-fraction and --disk-cpu-fraction must be in (0, 1]")
    try:
        args.workload_config = workload_config(args)
    except ValueError as e:
        p.error(str(e))
    return args


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(args.mode, args.users, args.rounds, args.context_tokens, args.system_tokens,
                          args.answer_tokens, args.seed, trace=args.trace, trace_block_tokens=args.trace_block_tokens,
                          trace_max_tokens=args.trace_max_tokens, trace_sample=args.trace_sample,
                          trace_requests=args.requests)


def plan_sizes(workload: Workload, kv_bytes: int, args: argparse.Namespace) -> dict:
    """vLLM's pages and the daemon's tiers for each engine, from the working set.

    vLLM pages are ``PAGE_TOKENS`` tokens; a request needs every page of its prompt and answer, so
    the small cache holds at least one longest request plus a page. The resident cache holds the
    working set with a page of slack per distinct prompt head and turn, plus two longest requests
    in flight. kvstore stores each prompt's full chunks and a tail block up to its last page, so
    kvstore-cpu's CPU tier is three times the working set."""
    ws_tokens = workload.working_set_tokens
    request_pages = math.ceil((workload.max_prompt_tokens + workload.config.answer_tokens) / PAGE_TOKENS)
    small = max(math.ceil(args.vllm_cache_fraction * ws_tokens / PAGE_TOKENS), request_pages + 1)
    slack = len({t.head for t in workload.turns}) + len(workload.turns)
    resident = math.ceil(ws_tokens / PAGE_TOKENS) + slack + 2 * request_pages
    ws_bytes = ws_tokens * kv_bytes
    return {"working_set_tokens": ws_tokens, "working_set_bytes": ws_bytes, "kv_bytes_per_token": kv_bytes,
            "max_model_len": request_pages * PAGE_TOKENS, "small_pages": small, "resident_pages": resident,
            "small_cache_vs_working_set": small * PAGE_TOKENS / ws_tokens,
            "kvstore_cpu_capacity": max(64 << 20, 3 * ws_bytes),
            "disk_cpu_capacity": max(32 << 20, int(args.disk_cpu_fraction * ws_bytes)),
            "disk_capacity": max(GiB, 4 * ws_bytes)}


def daemon_settings(engine: str, sizes: dict, folder: Path, args: argparse.Namespace) -> dict | None:
    if engine not in KVSTORE_ENGINES:
        return None
    settings: dict[str, object] = {"metrics_listen": f"127.0.0.1:{free_port()}", "summary_interval": 0}
    if engine == "kvstore-cpu":
        settings.update(cpu_capacity=sizes["kvstore_cpu_capacity"], disk_path="")
    else:
        settings.update(cpu_capacity=sizes["disk_cpu_capacity"], disk_path=str(folder / "disk"),
                        disk_capacity=sizes["disk_capacity"])
    for name in ("eviction", "admission"):
        if getattr(args, name):
            settings[name] = getattr(args, name)
    return settings


def fits(engine: str, sizes: dict) -> bool:
    """Whether the working set fits this kvstore engine's tiers."""
    room = {"kvstore-cpu": sizes["kvstore_cpu_capacity"],
            "kvstore-disk": sizes["disk_cpu_capacity"] + sizes["disk_capacity"]}.get(engine, 0)
    return room >= sizes["working_set_bytes"]


class Progress:
    def __init__(self, label: str) -> None:
        self.label, self.began = label, time.perf_counter()

    def __call__(self, done: int, count: int) -> None:
        print(f"\r  {self.label}: {done}/{count} requests done, {time.perf_counter() - self.began:5.0f} s",
              end="", file=sys.stderr, flush=True)


def run_engine(engine: str, qps: float, repeat: int, workload: Workload, sizes: dict, model_dir: Path,
               probe_prompt: list[int], folder: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One engine at one QPS with fresh processes: start, probe, play the workload, read metrics."""
    from kvstore.spawn import DaemonProcess

    run_dir = folder / f"{engine}-q{qps:g}-r{repeat}"
    run_dir.mkdir(parents=True)
    settings = daemon_settings(engine, sizes, run_dir, args)
    trace = run_dir / "trace.jsonl" if "trace_file" in connector_settings() else None
    daemon = DaemonProcess.in_folder(run_dir / "daemon", **settings) if settings else None
    daemon_metrics = f"http://{settings['metrics_listen']}/metrics" if settings else ""
    try:
        pages = sizes["resident_pages"] if engine == "resident" else sizes["small_pages"]
        gib = max(2, math.ceil(pages * PAGE_TOKENS * sizes["kv_bytes_per_token"] / GiB))
        spec = ServerSpec(model_dir, pages, sizes["max_model_len"], gib,
                          transfer_config(daemon.address, trace) if daemon else None)
        with VllmServer(spec, run_dir / "vllm.log", env) as server:
            cold = probe(server.url, probe_prompt, workload.config.answer_tokens, args.request_timeout)
            time.sleep(1.0)  # vLLM records its stats a step after the last output
            before = scrape(server.url + "/metrics"), scrape(daemon_metrics) if daemon else None
            began = time.time()
            sends = arrivals(workload, qps, args.seed)
            label = f"{engine} QPS {qps:g} repeat {repeat + 1}"
            records = asyncio.run(play(server.url, workload, sends, args.request_timeout, Progress(label)))
            print(file=sys.stderr)
            time.sleep(1.0)
            after = scrape(server.url + "/metrics"), scrape(daemon_metrics) if daemon else None
            startup_s = server.startup_s
    finally:
        if daemon:
            daemon.stop()
    summary = summarize(records, qps)
    trace_rows = [row for row in read_trace(trace) if row.get("t", began) >= began] if trace else []
    summary.update(cache_figures(before[0], after[0], before[1], after[1], trace_rows, summary["prompt_tokens"]))
    if trace and args.trace_out and trace.exists():
        Path(args.trace_out).mkdir(parents=True, exist_ok=True)
        shutil.copy(trace, Path(args.trace_out) / f"{args.mode}-{engine}-q{qps:g}-r{repeat}.jsonl")
    return {"engine": engine, "qps": qps, "repeat": repeat, "startup_s": startup_s, "probe_ttft_s": cold["ttft_s"],
            "pages": pages, "daemon": settings, "summary": summary, "records": records}


def run_order(engines: list[str], qps_list: list[float], repeats: int) -> list[tuple[int, float, str]]:
    """(repeat, qps, engine) in the order they run: engines forwards, then backwards, alternating
    over QPS points and repeats, so a drifting host favours none."""
    order = []
    step = 0
    for repeat in range(repeats):
        for qps in qps_list:
            names = engines if step % 2 == 0 else engines[::-1]
            order += [(repeat, qps, e) for e in names]
            step += 1
    return order


def print_table(table: dict[str, dict[float, dict]], runs: list[dict]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    head = (f"{'engine':<13}{'QPS':>5}  {'TTFT p50':>8} {'p90':>6} {'p99':>6} {'r>=2 p50':>8}  {'ITL p50':>7} "
            f"{'p99':>5}  {'req/s':>6} {'tok/s':>6}  {'vLLM hit':>8} {'kvs hit':>7}  {'MB in':>6} {'MB out':>6}")
    print(head + "\n" + "-" * len(head))
    for engine, points in table.items():
        for qps, s in sorted(points.items()):
            mb = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            print(f"{engine:<13}{qps:>5g}  {ms(s['ttft_p50_s']):>8} {ms(s['ttft_p90_s']):>6} {ms(s['ttft_p99_s']):>6} "
                  f"{ms(s['ttft_rounds2_p50_s']):>8}  {ms(s['itl_p50_s']):>7} {ms(s['itl_p99_s']):>5}  "
                  f"{s['completed_rps']:>6.3f} {s['output_tps']:>6.1f}  {pct(s['vllm_hit_ratio']):>8} "
                  f"{pct(s['kvstore_hit_ratio']):>7}  {mb(s['bytes_in_mb']):>6} {mb(s['bytes_out_mb']):>6}")
    print("(TTFT and ITL in ms, medians over repeats; hits: prompt tokens served by vLLM's own prefix cache and "
          "by kvstore; MB in/out: block bytes into and out of the daemon's tiers)")
    starts = [r["startup_s"] for r in runs]
    print(f"vLLM server start-up: median {statistics.median(starts):.1f} s "
          f"(min {min(starts):.1f}, max {max(starts):.1f})")


def plot(table: dict[str, dict[float, dict]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not importable here; skipped (the --json file has the figures)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, points in table.items():
        qps = sorted(points)
        ax.plot(qps, [points[q]["ttft_p50_s"] for q in qps], marker="o", label=engine)
    ax.set_xlabel("offered QPS")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def describe(workload: Workload) -> str:
    """The workload's shape in a few words, for the report and the plot's title."""
    c = workload.config
    if c.mode != "trace":
        return f"{c.users} users x {c.rounds} rounds, {c.context_tokens}-token contexts"
    lengths = [workload.prompt_tokens(t) for t in workload.turns]
    returning = sum(t.round >= 2 for t in workload.turns)
    return (f"{Path(c.trace).name}, 1 in {c.trace_sample} conversations, {c.trace_block_tokens}-token blocks, "
            f"prompts {min(lengths)}-{max(lengths)} tokens (median {statistics.median(lengths):.0f}), "
            f"{returning} continue an earlier request")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
    from vllm_ttft import document_setup, vllm_env

    began = time.perf_counter()
    config = args.workload_config
    _, tokenizer = gguf_config(find_smollm2_gguf())
    workload = build_workload(config, load_corpus(args.data), tokenizer.encode)
    probe_tokens = (statistics.median(workload.prompt_tokens(t) for t in workload.turns) if config.mode == "trace"
                    else args.context_tokens)
    probe_prompt, folder, model_dir = document_setup(int(probe_tokens), 0, "kvserve-")
    sizes = plan_sizes(workload, kv_bytes_per_token(model_dir), args)
    env = vllm_env()
    tracing = "trace_file" in connector_settings()
    print(f"{args.mode}: {len(workload.turns)} requests ({describe(workload)}, "
          f"{args.answer_tokens}-token answers) from {workload.source}; "
          f"working set {sizes['working_set_tokens']} tokens = {sizes['working_set_bytes'] / 1e6:.0f} MB of KV; "
          f"vLLM's small cache {sizes['small_pages']} pages of {PAGE_TOKENS} "
          f"({sizes['small_cache_vs_working_set']:.2f}x the working set), resident {sizes['resident_pages']} pages; "
          f"cores {env['VLLM_CPU_OMP_THREADS_BIND']}; scratch {folder}", flush=True)
    if not tracing:
        print("the connector has no trace_file setting yet: no per-request Lookup cost", flush=True)
    runs: list[dict] = []
    try:
        for repeat, qps, engine in run_order(args.engine_list, args.qps_list, args.repeats):
            run = run_engine(engine, qps, repeat, workload, sizes, model_dir, probe_prompt, folder, args, env)
            s = run["summary"]
            print(f"  {engine} QPS {qps:g} repeat {repeat + 1}: start-up {run['startup_s']:.1f} s, probe TTFT "
                  f"{run['probe_ttft_s']:.3f} s, TTFT p50 {s['ttft_p50_s']:.3f} s, {s['completed_rps']:.3f} req/s, "
                  f"{s['errors']} errors", flush=True)
            runs.append(run)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    table = {e: {q: median_summaries([r["summary"] for r in runs if r["engine"] == e and r["qps"] == q])
                 for q in args.qps_list} for e in args.engine_list}
    colds = [r["probe_ttft_s"] for r in runs if r["engine"] == "vllm" and r["probe_ttft_s"] is not None]
    cold = statistics.median(colds) if colds else None
    print()
    print_table(table, runs)
    for engine in args.engine_list:
        if engine in KVSTORE_ENGINES:
            s = table[engine][args.qps_list[-1]]
            cost = ("no trace" if s["lookup_p50_s"] is None else
                    f"p50 {s['lookup_p50_s'] * 1e3:.2f} ms, p99 {s['lookup_p99_s'] * 1e3:.2f} ms")
            print(f"{engine} connector Lookup cost at QPS {args.qps_list[-1]:g}: {cost}")
            skipped = {q: table[engine][q].get("stores_skipped") for q in args.qps_list}
            print(f"{engine} blocks not stored because the connector's save queue was behind: "
                  + ", ".join(f"{'-' if n is None else f'{n:.0f}'} at QPS {q:g}" for q, n in skipped.items()))
    if cold is not None:
        held = {e: [q for q in args.qps_list if sustains(table[e][q], cold, args.sustain_factor)] for e in table}
        print(f"cold probe TTFT (vLLM alone, idle): {cold:.3f} s; sustained QPS points: "
              + "; ".join(f"{e} {', '.join(f'{q:g}' for q in qs) or 'none'}" for e, qs in held.items()))
    targets = evaluate_targets(table, args.mode, cold, args.sustain_factor,
                               {e: fits(e, sizes) for e in KVSTORE_ENGINES})
    for target in targets:
        print(target.line())
    elapsed = time.perf_counter() - began
    print(f"took {elapsed / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k != "workload_config"},
            "workload": {**vars(config), "requests": len(workload.turns), "source": workload.source},
            "sizes": sizes, "cores": env["VLLM_CPU_OMP_THREADS_BIND"], "connector_trace": tracing,
            "cold_probe_ttft_s": cold, "runs": runs, "summary": {e: {f"{q:g}": s for q, s in p.items()}
                                                                 for e, p in table.items()},
            "targets": [t.as_dict() for t in targets], "elapsed_s": elapsed}, indent=1))
    if args.plot:
        plot(table, args.plot, f"{args.mode}, {describe(workload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
