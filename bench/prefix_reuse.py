"""Prefix reuse: time to first token over a long document, cold against warm from each place the KV can be.

For each context length (tokens of a document prompt) the same prompt is answered four ways with
SmolLM2-135M-Instruct, fp32, on the CPU, one new token each (TTFT only):

- cold      full prefill, no cache (``CachedEngine.generate(use_cache=False)``): the baseline;
- cpu       warm, every context chunk loaded from a daemon with only a CPU tier;
- disk      warm, every chunk loaded from a second daemon with no CPU tier (``--cpu-capacity 0``)
            and O_DIRECT reads (``--disk-o-direct true``), so the page cache is bypassed;
- resident  the context's KV already in the engine's memory; only the question is prefilled on
            top of it, then the cache is truncated back: no lookup, no load, no copy. The limit
            any cache can reach.

The prompt is ``document_prompt``'s layout cut at the context length, with a different question
each repeat::

    |<chat header><document ...............>|<question><assistant header>|
     '-- context_ids[:N], N = 1k..8k -------' '-- question_ids, ~30 -----'

Chunks of the context are stored in both daemons before timing (exported from one untimed prefill
of the longest context; the shorter contexts are exact token prefixes of it, so their chunk keys
are the first keys of the longest one). Every question is absent from the cache: the warm runs
reuse exactly N tokens and compute the question. Cells are medians of ``--repeats`` runs, after
one untimed run of every mode; the modes are interleaved within a repeat so shared-machine noise
falls on all of them alike. Ratios are against cold in the same run; load bandwidth is against
memcpy and O_DIRECT file-read ceilings measured in the same run on the same number of bytes.

    python bench/prefix_reuse.py [--contexts 1024 2048 4096 8192] [--repeats 3]
                                 [--json out.json] [--plot bench/prefix_reuse.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.warm_prefix import (  # noqa: E402  (the corpus, daemons, storing a context, ceilings, one run)
    Run, load_corpus, memcpy_gbps, o_direct_read_gbps, run_engine, start_daemon, stop_daemon, store_context)
from engine_adapter.cached import CachedEngine  # noqa: E402
from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402
from engine_adapter.reference.generate import sample_next  # noqa: E402
from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf  # noqa: E402
from engine_adapter.reference.kv_cache import KVCache  # noqa: E402
from engine_adapter.reference.model import LlamaModel  # noqa: E402
from engine_adapter.reference.prompts import document_prompt  # noqa: E402
from kvstore.keys import prefix_keys  # noqa: E402

MODES = ("cold", "cpu", "disk", "resident")
DISK_SETUP = "second daemon: --cpu-capacity 0 --disk-o-direct true (disk tier only, O_DIRECT reads)"


# -- the table's cells and the resident mode ---------------------------------------------------------


@dataclass
class Cell:
    context: int
    mode: str
    question_tokens: list[int] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.runs)

    @property
    def load_s(self) -> float:
        return statistics.median(r.load_s for r in self.runs)

    @property
    def prefill_s(self) -> float:
        return statistics.median(r.prefill_s for r in self.runs)


@torch.inference_mode()
def run_resident(model: LlamaModel, kv: KVCache, context_tokens: int, question_ids: list[int]) -> Run:
    """Prefill the question on top of a cache holding the context, then truncate back to it."""
    start = time.perf_counter()
    logits = model(torch.tensor(question_ids, dtype=torch.long), kv, context_tokens, last_only=True)[-1]
    sample_next(logits)
    ttft = time.perf_counter() - start
    kv.truncate(context_tokens)
    return Run(ttft, 0.0, ttft, context_tokens)


def resident_cache(model: LlamaModel, full_kv: KVCache, context_tokens: int, room: int) -> KVCache:
    kv = model.new_cache(context_tokens + room)
    kv.load(full_kv.export(0, context_tokens), 0)
    return kv


# -- report ------------------------------------------------------------------------------------------------


def fmt_context(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def check_targets(table: dict[int, dict[str, Cell]], at: int) -> list[dict]:
    targets = []

    def ratio(num: str, den: str, n: int) -> float:
        return table[n][num].ttft_s / table[n][den].ttft_s

    if at in table:
        value = ratio("cold", "cpu", at)
        targets.append(dict(name=f"warm from CPU >= 40x faster than cold at {fmt_context(at)}",
                            value=value, passed=value >= 40, detail=f"cold/cpu = {value:.1f}x"))
    else:
        targets.append(dict(name=f"warm from CPU >= 40x faster than cold at {fmt_context(at)}",
                            value=None, passed=None, detail=f"{at} not measured"))
    per_context = {n: ratio("cpu", "resident", n) for n in table}
    worst = max(per_context, key=per_context.get)
    targets.append(dict(name="warm from CPU within 1.5x of resident (every context)",
                        value=per_context[worst], passed=all(v <= 1.5 for v in per_context.values()),
                        detail="cpu/resident " + ", ".join(f"{fmt_context(n)} {v:.2f}x"
                                                          for n, v in per_context.items())))
    if at in table:
        value = ratio("cold", "disk", at)
        targets.append(dict(name=f"warm from disk >= 10x faster than cold at {fmt_context(at)}",
                            value=value, passed=value >= 10, detail=f"cold/disk = {value:.1f}x"))
    else:
        targets.append(dict(name=f"warm from disk >= 10x faster than cold at {fmt_context(at)}",
                            value=None, passed=None, detail=f"{at} not measured"))
    return targets


def plot(table: dict[int, dict[str, Cell]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted(table)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in zip(MODES, "osD^"):
        ax.plot(contexts, [table[n][mode].ttft_s for n in contexts], marker=marker, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [fmt_context(n) for n in contexts])
    ax.set_xlabel("context tokens (reused prefix)")
    ax.set_ylabel("time to first token, s (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="context lengths in tokens (default 1024 2048 4096 8192)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is kept (default 3)")
    parser.add_argument("--target-context", type=int, default=4096, help="context the x-faster targets use")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a few shared cores, OpenMP threads stall at barriers "
                             "whenever another process holds a core; 2 threads measured 2x slower here)")
    parser.add_argument("--folder", default=None, help="scratch folder for the disk tier (default: a temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--plot", metavar="PATH", default=str(ROOT / "bench" / "prefix_reuse.png"),
                        help="PNG of TTFT against context length ('' to skip; default bench/prefix_reuse.png)")
    args = parser.parse_args()
    if args.repeats < 1 or any(n < 256 or n % 256 for n in args.contexts):
        parser.error("--repeats must be >= 1 and every context a positive multiple of 256 tokens (the chunk "
                     "size), so that warm runs reuse the whole context")
    contexts = sorted(set(args.contexts))
    torch.set_num_threads(args.threads)

    log = lambda msg: tqdm.write(msg, file=sys.stderr)  # noqa: E731
    log("loading SmolLM2-135M-Instruct (fp32) ...")
    model, tokenizer = load_gguf(find_smollm2_gguf(), dtype=torch.float32)
    corpus = load_corpus(tokenizer, max(contexts) + 64)
    full_context, _ = document_prompt(tokenizer, corpus.document, corpus.questions[0])
    full_context = full_context[: max(contexts)]
    # Question r of the timed runs is question r+1 of the pool; question 0 is the warm-up's.
    prompts = [document_prompt(tokenizer, corpus.document, q)[1] for q in corpus.questions[: args.repeats + 1]]
    while len(prompts) < args.repeats + 1:  # a tiny pool: vary the question by its number
        prompts.append(document_prompt(tokenizer, corpus.document, f"{corpus.questions[0]} ({len(prompts)})")[1])
    room = max(len(q) for q in prompts) + 8

    scratch = Path(tempfile.mkdtemp(prefix="kvb-prefix-", dir=args.folder))
    daemons: list[DaemonProcess] = []
    try:
        cpu_proc, cpu_address = start_daemon(scratch / "cpu", cpu_capacity="1GiB", disk_path="")
        daemons.append(cpu_proc)
        disk_proc, disk_address = start_daemon(scratch / "disk", cpu_capacity=0, disk_path=scratch / "disk" / "blocks",
                                               disk_capacity="2GiB", disk_fsync="false", disk_o_direct="true")
        daemons.append(disk_proc)
        with KVStoreClient(cpu_address) as cpu_client, KVStoreClient(disk_address) as disk_client:
            engines = {"cpu": CachedEngine(model, tokenizer, cpu_client),
                       "disk": CachedEngine(model, tokenizer, disk_client)}
            chunk = engines["cpu"].namespace.chunk_tokens
            bytes_per_token = engines["cpu"].namespace.layout.block_bytes(chunk) // chunk

            log(f"prefilling the {len(full_context)}-token context once to store its chunks (untimed) ...")
            start = time.perf_counter()
            full_kv = model.new_cache(len(full_context))
            with torch.inference_mode():
                model(torch.tensor(full_context, dtype=torch.long), full_kv, 0, last_only=True)
            setup_prefill_s = time.perf_counter() - start
            keys = prefix_keys(engines["cpu"].namespace, full_context)
            store_context(cpu_client, engines["cpu"], keys, full_kv, "cpu")
            store_context(disk_client, engines["disk"], keys, full_kv, "disk")

            ceiling_bytes = min(contexts, key=lambda n: abs(n - args.target_context)) * bytes_per_token
            ceilings = {"memcpy_gbps": memcpy_gbps(ceiling_bytes),
                        "o_direct_read_gbps": o_direct_read_gbps(scratch, ceiling_bytes,
                                                                 bytes_per_token * chunk),
                        "bytes": ceiling_bytes}

            table: dict[int, dict[str, Cell]] = {n: {m: Cell(n, m) for m in MODES} for n in contexts}
            total = len(MODES) + len(contexts) * len(MODES) * args.repeats
            with tqdm(total=total, desc="runs", unit="run", file=sys.stderr) as bar:
                def one(mode: str, n: int, question_ids: list[int], kv: KVCache) -> Run:
                    bar.set_postfix_str(f"{fmt_context(n)} {mode}")
                    if mode == "resident":
                        run = run_resident(model, kv, n, question_ids)
                    else:
                        run = run_engine(engines["cpu" if mode == "cold" else mode], full_context[:n],
                                         question_ids, use_cache=mode != "cold", expect_tier=mode)
                    bar.update(1)
                    return run

                # One untimed run of every mode (first calls fault in arenas, caches, allocator pools).
                kv = resident_cache(model, full_kv, contexts[0], room)
                for mode in MODES:
                    one(mode, contexts[0], prompts[0], kv)
                for n in contexts:
                    kv = resident_cache(model, full_kv, n, room)
                    for r in range(args.repeats):
                        question_ids = prompts[r + 1]
                        for mode in MODES:
                            table[n][mode].runs.append(one(mode, n, question_ids, kv))
                            table[n][mode].question_tokens.append(len(question_ids))
                    del kv
            errors = {name: e.errors for name, e in engines.items()}
    finally:
        for proc in daemons:
            stop_daemon(proc)
        shutil.rmtree(scratch, ignore_errors=True)

    # -- the report
    q_tokens = sorted({len(q) for q in prompts[1:]})
    print(f"\nmodel SmolLM2-135M-Instruct fp32 on CPU, {args.threads} torch threads; chunk {chunk} tokens, "
          f"KV {bytes_per_token} B/token ({bytes_per_token * chunk / 1e6:.1f} MB/chunk)")
    print(f"context: {corpus.source}; document_prompt layout cut at N tokens, "
          f"question + assistant header {q_tokens[0]}-{q_tokens[-1]} tokens (not cached)")
    print(f"disk mode: {DISK_SETUP}")
    print(f"TTFT median of {args.repeats} (after 1 untimed run per mode); ratios are same-run\n")
    print(f"{'context':>7} {'cold s':>8} {'cpu s':>8} {'disk s':>8} {'resident s':>10} "
          f"{'cold/cpu':>9} {'cold/disk':>9} {'cpu/resident':>12}")
    for n in contexts:
        c = table[n]
        print(f"{fmt_context(n):>7} {c['cold'].ttft_s:>8.3f} {c['cpu'].ttft_s:>8.3f} {c['disk'].ttft_s:>8.3f} "
              f"{c['resident'].ttft_s:>10.4f} {c['cold'].ttft_s / c['cpu'].ttft_s:>8.1f}x "
              f"{c['cold'].ttft_s / c['disk'].ttft_s:>8.1f}x {c['cpu'].ttft_s / c['resident'].ttft_s:>11.2f}x")

    print(f"\nwhere warm time goes (medians, s): load = key hashing + cache allocation + Lookup + Get + copy into "
          f"the KV cache; prefill = the question tokens.\nload GB/s = context KV bytes / load; ceilings on "
          f"{ceilings['bytes'] / 1e6:.0f} MB: memcpy {ceilings['memcpy_gbps']:.2f} GB/s, "
          f"O_DIRECT file read {ceilings['o_direct_read_gbps']:.2f} GB/s")
    print(f"{'context':>7} {'cpu load':>9} {'cpu prefill':>11} {'cpu GB/s':>9} {'/memcpy':>8} "
          f"{'disk load':>9} {'disk prefill':>12} {'disk GB/s':>9} {'/O_DIRECT':>9} {'resident':>9}")
    for n in contexts:
        c = table[n]
        kv_bytes = n * bytes_per_token
        cpu_gbps = kv_bytes / c["cpu"].load_s / 1e9
        disk_gbps = kv_bytes / c["disk"].load_s / 1e9
        print(f"{fmt_context(n):>7} {c['cpu'].load_s:>9.3f} {c['cpu'].prefill_s:>11.4f} {cpu_gbps:>9.2f} "
              f"{cpu_gbps / ceilings['memcpy_gbps']:>8.2f} {c['disk'].load_s:>9.3f} {c['disk'].prefill_s:>12.4f} "
              f"{disk_gbps:>9.2f} {disk_gbps / ceilings['o_direct_read_gbps']:>9.2f} "
              f"{c['resident'].prefill_s:>9.4f}")

    targets = check_targets(table, args.target_context)
    print()
    for t in targets:
        verdict = "n/a " if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"{verdict}  {t['name']}: {t['detail']}")
    if any(errors.values()):
        print(f"daemon errors during the run: {errors}")

    if args.plot:
        plot(table, Path(args.plot), f"SmolLM2-135M fp32 CPU, TTFT median of {args.repeats}; disk = O_DIRECT")
        print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": "SmolLM2-135M-Instruct", "dtype": "float32", "threads": args.threads,
            "chunk_tokens": chunk, "kv_bytes_per_token": bytes_per_token, "context_source": corpus.source,
            "disk_setup": DISK_SETUP, "repeats": args.repeats, "setup_prefill_s": setup_prefill_s,
            "ceilings": ceilings, "daemon_errors": errors, "targets": targets,
            "cells": [{**{k: v for k, v in asdict(c).items()}, "median_ttft_s": c.ttft_s,
                       "median_load_s": c.load_s, "median_prefill_s": c.prefill_s}
                      for n in contexts for c in table[n].values()],
            "ratios": {str(n): {"cold/cpu": table[n]["cold"].ttft_s / table[n]["cpu"].ttft_s,
                                "cold/disk": table[n]["cold"].ttft_s / table[n]["disk"].ttft_s,
                                "cpu/resident": table[n]["cpu"].ttft_s / table[n]["resident"].ttft_s}
                       for n in contexts},
        }, indent=2))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
