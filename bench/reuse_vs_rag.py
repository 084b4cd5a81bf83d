"""Reuse vs RAG: answer MuSiQue questions over 10 passages, six ways, with SmolLM2-135M through the daemon.

Strategies (one question = 10 passages + a question; the prompt is the CacheBlend paper's MuSiQue
prompt in SmolLM2's chat template, each passage a chunk)::

    full          (a) full prefill of all 10 passages every time (the quality reference)
    prefix-cache  (b) the 10 passages cached once as a prefix (chained prefix keys), the question
                      appended: only the tail after the last full 256-token chunk is computed
    rag           (c) top-k passages by BM25 (k = --top-k), full prefill
    rag+reuse     (d) the same k passages' KV reused as stored chunks, nothing recomputed (r = 0)
    rag+blend     (e) CacheBlend on the k chunks: r in --ratios x every selector

All KV goes through one daemon (CPU tier). Stored KV is put before timing (ingest: the passages'
chunks for d/e; for b, the context's prefix chunks exported from (a)'s own prefill), then deleted
after the question. TTFT is request start to the first token (lookup, Get, assembly, compute);
(a) times its prefill only. Quality: F1 of the greedy answer (--max-new-tokens) against the gold
answers, and, for the first answer token, KL(P_ref || P) and greedy agreement with (a) and with (c).
A 135M model answers MuSiQue poorly, so F1 is small and noisy; KL and agreement are the sharper
measures of what reuse costs.

    python bench/reuse_vs_rag.py --limit 12 [--top-k 3] [--ratios 0.05 0.15 0.3] [--json out.json]
                                 [--plot-dir bench/] [--data ../shared/data/musique/dev.json]

MuSiQue: https://github.com/StonyBrookNLP/musique (CC BY 4.0); this file's default is the CacheBlend
paper's 10-passage dev set in the shared data folder, a JSON list of {question, answers, ctxs}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.musique import (  # noqa: E402  (the data, the prompt, retrieval, F1)
    MUSIQUE_DEV, Prompt, bm25_top_k, build_prompt, f1_score, musique_items)
from engine_adapter.blend_engine import BlendEngine  # noqa: E402
from blend.select import DEFAULT_SELECTOR, SELECTORS  # noqa: E402
from engine_adapter.cached import fetch_slot_bytes, fetched_tensor, model_namespace  # noqa: E402
from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from engine_adapter.reference.generate import decode_after, sample_next  # noqa: E402
from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf  # noqa: E402
from kvstore.keys import prefix_keys  # noqa: E402


# -- scoring against the references -------------------------------------------------------------


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    return float(F.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True, reduction="sum"))


# -- strategies ------------------------------------------------------------------------------------


@dataclass
class Run:
    strategy: str
    ttft_s: float
    prefilled: float
    loaded_bytes: int
    stored_bytes: int
    answer: str
    tokens: list[int] = field(repr=False)
    logits: torch.Tensor = field(repr=False)


def finish(model, tokenizer, kv, logits, max_new_tokens) -> list[int]:
    return decode_after(model, kv, sample_next(logits), max_new_tokens, tokenizer.eos_token_ids)


def answer_text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True).strip().split("\n")[0]


@torch.inference_mode()
def run_full(model, tokenizer, client, namespace, prompt: Prompt, max_new) -> Run:
    """(a), and, untimed in the middle, the context's prefix chunks stored for (b)."""
    context = prompt.ids(list(range(len(prompt.chunks))))[: -len(prompt.query)]
    kv = model.new_cache(len(context) + len(prompt.query) + max_new)
    started = time.perf_counter()
    model(torch.tensor(context), kv, 0, last_only=True)
    context_s = time.perf_counter() - started
    keys = prefix_keys(namespace, context)
    n = namespace.chunk_tokens
    for c, key in enumerate(keys):
        client.put(namespace, [(key, n, kv.export(c * n, (c + 1) * n))])
    started = time.perf_counter()
    logits = model(torch.tensor(prompt.query), kv, len(context), last_only=True)[-1]
    sample_next(logits)
    ttft = context_s + time.perf_counter() - started
    tokens = finish(model, tokenizer, kv, logits, max_new)
    return Run("full", ttft, len(context) + len(prompt.query), 0, 0, answer_text(tokenizer, tokens), tokens, logits)


@torch.inference_mode()
def run_prefix_cache(model, tokenizer, client, namespace, prompt: Prompt, max_new) -> Run:
    """(b): lookup + Get of the stored prefix chunks, then the rest of the prompt."""
    ids = prompt.ids(list(range(len(prompt.chunks))))
    n = namespace.chunk_tokens
    started = time.perf_counter()
    keys = prefix_keys(namespace, ids[:-1])
    hits = client.lookup(keys).hits
    kv = model.new_cache(len(ids) + max_new)
    slot = fetch_slot_bytes(namespace.layout, n)
    step = client.max_fetch_blocks(slot)
    for first in range(0, hits, step):
        with client.fetch(keys[first : min(hits, first + step)], slot) as blocks:
            for i, block in enumerate(blocks):
                kv.load(fetched_tensor(block), (first + i) * n)
    reused = hits * n
    logits = model(torch.tensor(ids[reused:]), kv, reused, last_only=True)[-1]
    sample_next(logits)
    ttft = time.perf_counter() - started
    tokens = finish(model, tokenizer, kv, logits, max_new)
    stored = namespace.layout.block_bytes(len(keys) * n)
    return Run("prefix-cache", ttft, len(ids) - reused, namespace.layout.block_bytes(reused), stored,
               answer_text(tokenizer, tokens), tokens, logits)


@torch.inference_mode()
def run_rag(model, tokenizer, prompt: Prompt, chosen: list[int], max_new) -> Run:
    """(c): full prefill of the retrieved passages."""
    ids = prompt.ids(chosen)
    kv = model.new_cache(len(ids) + max_new)
    started = time.perf_counter()
    logits = model(torch.tensor(ids), kv, 0, last_only=True)[-1]
    sample_next(logits)
    ttft = time.perf_counter() - started
    tokens = finish(model, tokenizer, kv, logits, max_new)
    return Run("rag", ttft, len(ids), 0, 0, answer_text(tokenizer, tokens), tokens, logits)


def run_blend(engine: BlendEngine, tokenizer, prompt: Prompt, chosen: list[int], name: str, ratio: float,
              selector: str, max_new) -> Run:
    """(d) with ratio 0, (e) otherwise."""
    result = engine.generate(prompt.prefix, [prompt.chunks[i] for i in chosen], prompt.query,
                             max_new_tokens=max_new, ratio=ratio, selector=selector, store=False)
    if result.computed_segments:
        raise RuntimeError(f"{name}: {result.computed_segments} chunks were not stored; the ingest failed")
    layout = engine.namespace.layout
    stored = layout.block_bytes(len(prompt.prefix) + sum(len(prompt.chunks[i]) for i in chosen))
    return Run(name, result.ttft_s, result.prefilled_tokens, result.loaded_bytes, stored,
               answer_text(tokenizer, result.tokens), result.tokens, result.first_logits)


def strategy_names(ratios, selectors) -> list[str]:
    names = ["full", "prefix-cache", "rag", "rag+reuse"]
    return names + [f"rag+blend {sel} r={r:g}" for sel in selectors for r in ratios]


# -- report ----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(records: list[dict], names: list[str]) -> dict[str, dict]:
    summary = {}
    for name in names:
        rows = [r[name] for r in records]
        ttft = [r["ttft_s"] for r in rows]
        summary[name] = dict(
            ttft_p50=statistics.median(ttft), ttft_p90=percentile(ttft, 0.9),
            prefilled=statistics.mean(r["prefilled"] for r in rows),
            loaded_mb=statistics.mean(r["loaded_bytes"] for r in rows) / 1e6,
            stored_mb=statistics.mean(r["stored_bytes"] for r in rows) / 1e6,
            f1=statistics.mean(r["f1"] for r in rows),
            kl_full=statistics.mean(r["kl_full"] for r in rows),
            kl_rag=statistics.mean(r["kl_rag"] for r in rows),
            agree_full=statistics.mean(r["agree_full"] for r in rows),
            agree_rag=statistics.mean(r["agree_rag"] for r in rows),
            same_answer_rag=statistics.mean(r["same_answer_rag"] for r in rows),
        )
    return summary


def markdown(summary: dict[str, dict]) -> str:
    rag = summary["rag"]["ttft_p50"]
    lines = ["| strategy | TTFT p50 | TTFT p90 | vs rag | tokens prefilled | KV loaded MB | stored MB/q | F1 | "
             "KL vs full | KL vs rag | agree@1 full | agree@1 rag | same answer as rag |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['ttft_p50']:.2f}s | {s['ttft_p90']:.2f}s | {rag / s['ttft_p50']:.1f}x | "
                     f"{s['prefilled']:.0f} | {s['loaded_mb']:.0f} | {s['stored_mb']:.0f} | {s['f1']:.3f} | "
                     f"{max(s['kl_full'], 0.0):.3f} | {max(s['kl_rag'], 0.0):.3f} | {s['agree_full']:.2f} | {s['agree_rag']:.2f} | "
                     f"{s['same_answer_rag']:.2f} |")
    return "\n".join(lines)


def targets(summary: dict[str, dict], selector: str = DEFAULT_SELECTOR) -> list[dict]:
    rag, naive = summary["rag"], summary["rag+reuse"]
    blend = summary.get(f"rag+blend {selector} r=0.15")
    if blend is None:
        return []
    speedup = rag["ttft_p50"] / blend["ttft_p50"]
    return [
        dict(name="r=0.15 TTFT >= 3x lower than RAG full prefill", passed=speedup >= 3, detail=f"{speedup:.1f}x"),
        dict(name="r=0.15 F1 within 0.02 of RAG full prefill", passed=abs(blend["f1"] - rag["f1"]) <= 0.02,
             detail=f"{blend['f1']:.3f} vs {rag['f1']:.3f}"),
        dict(name="r=0.15 F1 clearly above naive reuse (> +0.02)", passed=blend["f1"] - naive["f1"] > 0.02,
             detail=f"{blend['f1']:.3f} vs {naive['f1']:.3f}"),
        dict(name="r=0.15 KL vs RAG below naive reuse's", passed=blend["kl_rag"] < naive["kl_rag"],
             detail=f"{blend['kl_rag']:.3f} vs {naive['kl_rag']:.3f}"),
        dict(name="r=0.15 KL vs RAG clearly below naive reuse's (<= 0.8x)",
             passed=blend["kl_rag"] <= 0.8 * naive["kl_rag"], detail=f"{blend['kl_rag'] / naive['kl_rag']:.2f}x"),
    ]


def plot(summary: dict[str, dict], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    names = list(summary)
    p50 = [summary[n]["ttft_p50"] for n in names]
    p90 = [summary[n]["ttft_p90"] for n in names]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.bar(range(len(names)), p50, label="p50")
    ax.scatter(range(len(names)), p90, color="black", marker="_", s=200, label="p90", zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("Time to first token per strategy (SmolLM2-135M, CPU)")
    ax.legend()
    fig.tight_layout()
    ttft_path = folder / "reuse_vs_rag_ttft.png"
    fig.savefig(ttft_path, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 5))
    for name in names:
        s = summary[name]
        ax.scatter(s["ttft_p50"], s["f1"])
        ax.annotate(name, (s["ttft_p50"], s["f1"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p50 (s)")
    ax.set_ylabel("F1")
    ax.set_title("F1 against TTFT")
    fig.tight_layout()
    f1_path = folder / "reuse_vs_rag_f1.png"
    fig.savefig(f1_path, dpi=120)
    plt.close(fig)
    return [ttft_path, f1_path]


# -- main ------------------------------------------------------------------------------------------


def start_daemon(folder: Path, cpu_capacity: str) -> tuple[subprocess.Popen, str]:
    address = f"unix:{folder / 'kvstore.sock'}"
    args = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", address, "--log-level", "WARNING",
            "--cpu-capacity", cpu_capacity, "--disk-path", ""]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, cwd=ROOT, env=env)
    line = proc.stdout.readline().decode()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return proc, address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(MUSIQUE_DEV) if MUSIQUE_DEV.exists() else None,
                        help="MuSiQue JSON list of {question, answers, ctxs} (default: ../shared/data/musique/dev.json)")
    parser.add_argument("--limit", type=int, default=12, help="questions to run (each costs ~1 min on 2 cores)")
    parser.add_argument("--seed", type=int, default=0, help="which questions: a seeded sample of the data")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3])
    parser.add_argument("--selectors", nargs="+", default=sorted(SELECTORS), choices=sorted(SELECTORS))
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 measured fastest on 2 shared cores)")
    parser.add_argument("--cpu-capacity", default="3GiB")
    parser.add_argument("--json", default=None, help="write per-question rows and the summary here")
    parser.add_argument("--plot-dir", default=None, help="write reuse_vs_rag_ttft.png and reuse_vs_rag_f1.png here")
    args = parser.parse_args()
    data = musique_items(args.data)  # one line naming the file when it cannot be used
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
    questions = [data[i] for i in order[: args.limit]]
    model, tokenizer = load_gguf(find_smollm2_gguf(), dtype=torch.float32)
    namespace = model_namespace(model)
    names = strategy_names(args.ratios, args.selectors)
    scratch = Path(tempfile.mkdtemp(prefix="kvs-rag-"))
    proc, address = start_daemon(scratch, args.cpu_capacity)
    records: list[dict] = []
    try:
        with KVStoreClient(address, arena_bytes=1 << 30) as client:
            engine = BlendEngine(model, tokenizer, client)
            warm = build_prompt(tokenizer, [c["text"] for c in questions[0]["ctxs"]][:2], "warm up?")
            engine.generate(warm.prefix, warm.chunks, warm.query, max_new_tokens=2)  # untimed warm-up
            client.clear()
            for item in tqdm(questions, desc="questions", unit="q"):
                passages = [c["text"] for c in item["ctxs"]]
                prompt = build_prompt(tokenizer, passages, item["question"])
                chosen = bm25_top_k(item["question"], passages, args.top_k)
                engine.ingest([prompt.prefix] + [prompt.chunks[i] for i in chosen])  # chunk KV, stored once
                runs = {}
                runs["full"] = run_full(model, tokenizer, client, namespace, prompt, args.max_new_tokens)
                runs["prefix-cache"] = run_prefix_cache(model, tokenizer, client, namespace, prompt, args.max_new_tokens)
                runs["rag"] = run_rag(model, tokenizer, prompt, chosen, args.max_new_tokens)
                runs["rag+reuse"] = run_blend(engine, tokenizer, prompt, chosen, "rag+reuse", 0.0, DEFAULT_SELECTOR,
                                              args.max_new_tokens)  # r = 0: the selector is never asked
                for name in names[4:]:
                    selector, ratio = name.split()[1], float(name.split("r=")[1])
                    runs[name] = run_blend(engine, tokenizer, prompt, chosen, name, ratio, selector, args.max_new_tokens)
                full, rag = runs["full"], runs["rag"]
                record = {"question": item["question"], "answers": item["answers"], "chosen": chosen,
                          "tokens_full": full.prefilled, "tokens_rag": rag.prefilled}
                for name, run in runs.items():
                    record[name] = dict(
                        ttft_s=run.ttft_s, prefilled=run.prefilled, loaded_bytes=run.loaded_bytes,
                        stored_bytes=run.stored_bytes, answer=run.answer, f1=f1_score(run.answer, item["answers"]),
                        kl_full=kl(full.logits, run.logits), kl_rag=kl(rag.logits, run.logits),
                        agree_full=float(run.tokens[0] == full.tokens[0]), agree_rag=float(run.tokens[0] == rag.tokens[0]),
                        same_answer_rag=float(run.answer == rag.answer))
                records.append(record)
                client.clear()  # bound the daemon's memory: this question's blocks are not reused
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)

    summary = summarize(records, names)
    mean_full = statistics.mean(r["tokens_full"] for r in records)
    mean_rag = statistics.mean(r["tokens_rag"] for r in records)
    print(f"\n{len(records)} MuSiQue questions (seed {args.seed}), SmolLM2-135M-Instruct fp32 on CPU, "
          f"{args.threads} thread(s); prompt {mean_full:.0f} tokens with 10 passages, {mean_rag:.0f} with "
          f"top-{args.top_k} (BM25); KV {namespace.layout.block_bytes(1) / 1e3:.0f} kB/token; daemon CPU tier\n")
    print(markdown(summary))
    checks = targets(summary, selector=DEFAULT_SELECTOR)
    print(f"\ntargets ({DEFAULT_SELECTOR}, the default selector, r = 0.15):")
    if not checks:
        print(f"  not run: add {DEFAULT_SELECTOR} to --selectors and 0.15 to --ratios")
    for check in checks:
        print(f"  [{'pass' if check['passed'] else 'FAIL'}] {check['name']}: {check['detail']}")
    if args.json:  # before the plots: a plotting failure must not lose a long run's numbers
        Path(args.json).write_text(json.dumps(dict(args=vars(args), summary=summary, targets=checks,
                                                   records=records), indent=1))
        print(f"wrote {args.json}")
    if args.plot_dir:
        for path in plot(summary, Path(args.plot_dir)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
