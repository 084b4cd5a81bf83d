"""RAG passages in vLLM: full prefill, vLLM's own prefix cache, kvstore naive reuse and CacheBlend.

Per MuSiQue question (the CacheBlend paper's prompt, top-k BM25 passages, k = --top-k; 0: all 10)::

    full       vLLM's full prefill of the prompt (the quality and speed reference), first sight
    resident   the same prompt again, in a vLLM of its own with its prefix cache on: vLLM's own reuse
    naive      a kvstore blend request at ratio 0: passages' KV reused as stored, only the query computed
    blend r    a kvstore blend request at ratio r (--ratios), selector --selector (default stale_attention)
    marked r   (--markers) the prompt as text with the passages marked (blend_separator), which vLLM
               tokenizes whole, blended at the first ratio; its KL and speed-up are against vLLM's full
               prefill of that text (its tokens differ a little from the parts tokenized alone)

Passages are stored first by the reference engine (``BlendEngine.ingest``), so every blend request
finds them: vLLM reuses blocks another engine stored. full, naive and the blends run in one vLLM
process (prefix cache off, kvstore as a kv_consumer: it loads and never stores, so a full prefill
costs only a missed lookup more), question by question, in alternating order (full first, then
last), --repeats times: load on the host falls on every side alike, and the speed-ups are paired
within a question and repeat. The recompute's cost is ``(blend - naive) / full / r``: what
recomputing a fraction r of the passages costs, as a multiple of r times the full prefill (1: as
much per token as the full prefill). TTFT is vLLM's own first-token latency of the request (engine
front end to first token, before detokenizing the logprobs); KL is KL(P_full || P) of the first
new token over the whole vocabulary; top-1 agreement with full; F1 of the greedy answer. The
reference engine's own blend KL (``BlendEngine`` at the first ratio against its own full prefill)
is printed beside vLLM's. The report starts with the host's ISA flags (vLLM's CPU attention and
matrix products take other paths with AMX, AVX-512 or AVX2 alone), and every figure has its spread:
TTFT and KL min-max over questions, ratios min-max over questions and repeats.

Targets (issue #55): blend at the first ratio >= 3x full prefill at top-3 (>= 4x with all 10
passages), recompute cost (blend - naive) / full / r <= 1.3, KL <= 0.5x naive's, worse than naive
on at most 1 question in 10.

    .venv-vllm/bin/python bench/vllm_rag.py --questions 20 [--top-k 3] [--ratios 0.15 0.3] [--repeats 3]
        [--markers] [--no-reference] [--json out.json] [--plot bench/vllm_rag.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from blend.prompt import split_prompt  # noqa: E402
from engine_adapter.blend_engine import BlendEngine  # noqa: E402
from blend.select import DEFAULT_SELECTOR, SELECTORS  # noqa: E402
from engine_adapter.client.kvstore_client import KVStoreClient  # noqa: E402
from engine_adapter.reference.loader import load_hf_folder  # noqa: E402
from engine_adapter.vllm.blend import BLEND_PARAM  # noqa: E402
from engine_adapter.vllm.hf_folder import write_hf_folder  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402
from bench.host_isa import isa_line, isa_summary  # noqa: E402
from bench.musique import MUSIQUE_DEV, SEP, bm25_top_k, build_prompt, f1_score, musique_items, prompt_text  # noqa: E402


def kl(ref: list[float] | torch.Tensor, other: list[float] | torch.Tensor) -> float:
    """KL(P || Q) of two log-probability (or logit) vectors."""
    p = torch.as_tensor(ref, dtype=torch.float64).log_softmax(-1)
    q = torch.as_tensor(other, dtype=torch.float64).log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def run_vllm(folder: Path, work: Path, name: str, prompts: list, address: str | None, args: list[str],
             new_tokens: int, max_model_len: int, dtype: str) -> list[dict]:
    prompts_file, out = work / f"{name}.prompts.json", work / f"{name}.json"
    prompts_file.write_text(json.dumps(prompts))
    progress(f"vLLM run {name!r}: {len(prompts)} requests (log: {work / f'{name}.log'})")
    cmd = [sys.executable, "-m", "engine_adapter.vllm.run", "--model", str(folder), "--prompts", str(prompts_file),
           "--dtype", dtype, "--out", str(out), "--max-tokens", str(new_tokens), "--logprobs",
           "--max-model-len", str(max_model_len), *args]
    if address:
        cmd += ["--kvstore", address]
    log = work / f"{name}.log"
    with open(log, "wb") as sink:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"vLLM run {name} failed; see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())["outputs"]


def progress(line: str) -> None:
    """One line of progress on stderr (a run takes minutes; the table comes at the end)."""
    print(line, file=sys.stderr, flush=True)


def ttft(output: dict) -> float:
    return output.get("first_token_latency_s") or output["seconds"]


def spread(values: list[float], digits: int = 2) -> str:
    """min-max of ``values`` (e.g. a ratio over questions and repeats), as text."""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def report_targets(mode: str, s: dict, naive: dict, floor: float, questions: int) -> None:
    """Issue #55's targets for one blend mode's summary ``s`` (``naive``: naive reuse's)."""
    checks = [(f"TTFT vs full prefill >= {floor:.0f}x", s["speedup_vs_full"], s["speedup_vs_full"] >= floor,
               spread([s["speedup_min"], s["speedup_max"]])),
              ("KL <= 0.5x naive", s["kl_mean"] / max(naive["kl_mean"], 1e-12), s["kl_mean"] <= 0.5 * naive["kl_mean"],
               None),
              ("worse than naive <= 1 in 10", s["worse_than_naive"] / questions,
               s["worse_than_naive"] <= questions / 10, None)]
    if "recompute_cost" in s:
        checks.append(("recompute cost (blend - naive) / full / r <= 1.3", s["recompute_cost"],
                       s["recompute_cost"] <= 1.3, spread(s["recompute_cost_spread"])))
    for name, value, met, each in checks:
        print(f"target {name} at {mode}: {value:.2f}{f' ({each})' if each else ''} {'met' if met else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--skip", type=int, default=0, help="start at this question (keep a part aside)")
    parser.add_argument("--top-k", type=int, default=3, help="BM25 passages per question; 0: all 10")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    parser.add_argument("--selector", default=DEFAULT_SELECTOR, choices=sorted(SELECTORS),
                        help=f"blend selector of every blend request and of the reference engine "
                             f"(default {DEFAULT_SELECTOR})")
    parser.add_argument("--compare", default=None, choices=sorted(SELECTORS),
                        help="also blend at the first ratio with this selector, in the same process and alternating "
                             "order (a paired comparison of two selectors; its own mode, cost and targets)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="model and KV dtype of vLLM and the reference engine alike (float32 on a CPU "
                             "whose bf16 products are emulated, e.g. AVX2 without AVX-512-BF16 or AMX)")
    parser.add_argument("--data", type=Path, default=MUSIQUE_DEV)
    parser.add_argument("--json", type=Path, default=None, help="per-question records")
    parser.add_argument("--plot", type=Path, default=None, help="PNG: TTFT and KL per mode")
    parser.add_argument("--markers", action="store_true",
                        help="also the marked-text mode: passages marked in the prompt's text, not in kv_transfer_params")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each question's full, naive and blend requests this many times (alternating order)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the reference engine's own full and blended prefill (its KL); passages are still "
                             "stored by it")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    musique_items(args.data)  # before a run of minutes: one line naming the file when it cannot be used
    if args.plot:  # before a run of minutes, not after it
        try:
            import matplotlib
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None

    work = Path(tempfile.mkdtemp(prefix="kvs-vllm-rag-"))

    def blend_params(**spec) -> dict:
        """A blend request's kv_transfer_params, with the run's selector."""
        return {BLEND_PARAM: {**spec, "selector": args.selector}}

    name = "kvstore-test-hf-v1" + ("" if args.dtype == "bfloat16" else f"-{args.dtype}")  # bf16: the tests' folder
    folder = write_hf_folder(Path(tempfile.gettempdir()) / name, dtype=args.dtype)
    model, tokenizer = load_hf_folder(folder, dtype=getattr(torch, args.dtype))
    items = json.loads(args.data.read_text())[args.skip : args.skip + args.questions]
    cases = []
    for item in items:
        passages = [c["text"] for c in item["ctxs"]]  # as bench/reuse_vs_rag.py and bench/codec_quality.py
        prompt = build_prompt(tokenizer, passages, item["question"])
        chosen = bm25_top_k(item["question"], passages, args.top_k) if args.top_k else list(range(len(passages)))
        lengths = [len(prompt.prefix), *(len(prompt.chunks[i]) for i in chosen)]
        case = {"prompt": prompt, "chosen": chosen, "ids": prompt.ids(chosen), "lengths": lengths,
                "answers": item.get("answers") or [item.get("answer", "")]}
        if args.markers:  # the same prompt as marked text, and its cut as vLLM's tokens give it
            case["text"] = prompt_text(tokenizer, [passages[i] for i in chosen], item["question"])
            case["whole"] = split_prompt(tokenizer, case["text"], SEP, whole=True)
        cases.append(case)
    modes = ["full", "resident", "naive"] + [f"blend r={r}" for r in args.ratios]
    marked_mode = f"marked r={args.ratios[0]}"
    compare_mode = f"{args.compare} r={args.ratios[0]}"  # --compare: the other selector's blend
    # the CPU tier holds every passage of the run (all 10 passages of 20 questions are ~2.8 GB in
    # bf16): an evicted passage would be computed alone again and its request timed as a miss
    cfg = model.config
    token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.finfo(model.dtype).bits // 8
    stored = sum(sum(case["lengths"]) for case in cases)
    capacity = max(2 << 30, int(1.25 * stored * token_bytes) + (256 << 20))
    daemon = DaemonProcess.in_folder(work / "d", cpu_capacity=capacity, disk_path="")
    try:
        with KVStoreClient(daemon.address) as client:
            engine = BlendEngine(model, tokenizer, client, selector=args.selector)
            reference_kl = []
            for number, case in enumerate(cases, 1):
                progress(f"reference engine: question {number}/{len(cases)} (passages stored, full and blended prefill)")
                p = case["prompt"]
                engine.ingest([p.prefix] + [p.chunks[i] for i in case["chosen"]])
                if args.markers:  # the passages as the whole text's cut has them (docs/vllm.md)
                    engine.ingest([case["whole"].prefix] + case["whole"].chunks)
                if not args.reference:
                    reference_kl.append(float("nan"))
                    continue
                with torch.inference_mode():
                    full = model(torch.tensor(case["ids"]), model.new_cache(len(case["ids"]) + 1), 0, last_only=True)[-1]
                blended = engine.generate(p.prefix, [p.chunks[i] for i in case["chosen"]], p.query, max_new_tokens=1,
                                          ratio=args.ratios[0], store=False)
                reference_kl.append(kl(full.float(), blended.first_logits.float()))
        # each run starts with a request that is not counted (vLLM's first forward, and the first
        # blend's model load, take seconds): a stored passage under a prefix no case shares
        head, tail = tokenizer.encode("Warm-up: read this."), tokenizer.encode(" Done?")
        passage = cases[0]["prompt"].chunks[cases[0]["chosen"][0]]
        warm = {"prompt_token_ids": head + passage + tail,
                "kv_transfer_params": blend_params(lengths=[len(head), len(passage)], ratio=args.ratios[0])}
        # resident: vLLM's prefix cache (the prompt's second sight, in a run of its own)
        plain = run_vllm(folder, work, "plain", [warm["prompt_token_ids"]] + [c["ids"] for c in cases for _ in range(2)],
                         None, [], args.max_new_tokens, args.max_model_len, args.dtype)[1:]
        marked_full = []
        if args.markers:  # the marked texts' own full prefills, in a run of their own without a prefix
            # cache (a text shares its head with the prompt above)
            marked_full = run_vllm(folder, work, "marked-full", [warm["prompt_token_ids"]] + [{"prompt": c["text"]} for c in cases],
                                   None, ["--no-prefix-caching"], args.max_new_tokens, args.max_model_len, args.dtype)[1:]
        if args.markers:
            modes.append(marked_mode)
        if args.compare:
            modes.append(compare_mode)
        timed_modes = [m for m in modes if m != "resident"]  # one vLLM process, alternating order
        timed, order = [], []  # the requests, and (question, repeat, mode) of each
        for i, c in enumerate(cases):
            requests = {"full": {"prompt_token_ids": c["ids"]},
                        **{mode: {"prompt_token_ids": c["ids"],
                                  "kv_transfer_params": blend_params(lengths=c["lengths"], ratio=r)}
                           for mode, r in zip(timed_modes[1:], [0.0, *args.ratios])}}
            if args.markers:  # no lengths: the connector finds the passages from the separators in the text
                requests[marked_mode] = {"prompt": c["text"], "kv_transfer_params": blend_params(ratio=args.ratios[0])}
            if args.compare:
                requests[compare_mode] = {"prompt_token_ids": c["ids"], "kv_transfer_params": {BLEND_PARAM: {
                    "lengths": c["lengths"], "ratio": args.ratios[0], "selector": args.compare}}}
            for repeat in range(args.repeats):
                turn = timed_modes if (i * args.repeats + repeat) % 2 == 0 else timed_modes[::-1]
                timed += [requests[mode] for mode in turn]
                order += [(i, repeat, mode) for mode in turn]
        timed_out = run_vllm(folder, work, "timed", [{"prompt_token_ids": warm["prompt_token_ids"]}, warm] + timed,
                             daemon.address, ["--no-prefix-caching", "--kv-role", "kv_consumer",
                                              "--kv-extra", json.dumps({"blend_separator": SEP})],
                             args.max_new_tokens, args.max_model_len, args.dtype)[2:]
    finally:
        daemon.stop()
    outputs: dict[tuple[int, int, str], dict] = dict(zip(order, timed_out))
    # the blend modes with a recompute cost: each ratio's, and --compare's at the first ratio
    blended = [(f"blend r={r}", r) for r in args.ratios] + ([(compare_mode, args.ratios[0])] if args.compare else [])
    records = []
    for i, case in enumerate(cases):
        record = {"question": args.skip + i, "prompt_tokens": len(case["ids"]), "cached_tokens": sum(case["lengths"]),
                  "reference_blend_kl": reference_kl[i], "modes": {}}
        fulls = [outputs[i, repeat, "full"] for repeat in range(args.repeats)]
        for mode in modes:
            if mode == "resident":
                outs = [plain[2 * i + 1]]
            else:
                outs = [outputs[i, repeat, mode] for repeat in range(args.repeats)]
            out = outs[0]
            full = marked_full[i] if mode == marked_mode else fulls[0]  # the marked text's own reference
            # a ratio to full within one repeat: the two ran next to each other (the resident's full is
            # its run's first sight)
            pairs = [(plain[2 * i], outs[0])] if mode == "resident" else \
                [(marked_full[i], o) for o in outs] if mode == marked_mode else list(zip(fulls, outs))
            record["modes"][mode] = {"ttft_s": statistics.median(ttft(o) for o in outs),
                                     "ttft_repeats_s": [ttft(o) for o in outs],
                                     "speedups": [ttft(f) / ttft(o) for f, o in pairs],
                                     "kl": kl(full["first_logprobs"], out["first_logprobs"]),
                                     "agree": out["token_ids"][0] == full["token_ids"][0],
                                     "f1": f1_score(out["text"], case["answers"]),
                                     "cached": out["num_cached_tokens"], "text": out["text"],
                                     "full_ttft_s": statistics.median(ttft(f) for f, _ in pairs)}
        for mode, r in blended:  # the recompute's cost, per repeat: (blend - naive) / full / r
            blend = record["modes"][mode]
            blend["recompute_cost"] = [(ttft(b) - ttft(n)) / ttft(f) / r for f, n, b in zip(
                fulls, [outputs[i, k, "naive"] for k in range(args.repeats)],
                [outputs[i, k, mode] for k in range(args.repeats)])] if r > 0 else []
        records.append(record)

    print(isa_line())
    print(f"{len(records)} questions, top-{args.top_k or 'all'} passages, "
          f"{statistics.mean(r['prompt_tokens'] for r in records):.0f} prompt tokens on average")
    print(f"full, naive and blends timed in one vLLM process, alternating order, {args.repeats} repeat(s) each; "
          f"'vs full' is the median of per-question, per-repeat ratios; spreads min-max (TTFT, KL: over questions)")
    width = max(14, *(len(m) + 1 for m in modes))
    print(f"{'mode':<{width}}{'TTFT p50':>10}{'spread ms':>12}{'vs full':>9}{'spread':>12}{'KL mean':>10}{'spread':>16}"
          f"{'top-1':>7}{'F1':>7}{'worse than naive':>18}")
    summary = {}
    for mode in modes:
        rows = [r["modes"][mode] for r in records]
        ttfts = [row["ttft_s"] for row in rows]
        speedups = [x for row in rows for x in row["speedups"]]
        speedup = statistics.median(speedups)
        worse = sum(r["modes"][mode]["kl"] > r["modes"]["naive"]["kl"] for r in records)
        kls = [row["kl"] for row in rows]
        summary[mode] = {"ttft_p50_s": statistics.median(ttfts), "ttft_spread_s": [min(ttfts), max(ttfts)],
                         "speedup_vs_full": speedup, "speedup_min": min(speedups), "speedup_max": max(speedups),
                         "kl_mean": statistics.mean(kls), "kl_spread": [min(kls), max(kls)],
                         "agree": statistics.mean(row["agree"] for row in rows),
                         "f1": statistics.mean(row["f1"] for row in rows), "worse_than_naive": worse}
        costs = [x for row in rows for x in row.get("recompute_cost", [])]
        if costs:
            summary[mode]["recompute_cost"] = statistics.median(costs)
            summary[mode]["recompute_cost_spread"] = [min(costs), max(costs)]
        s = summary[mode]
        print(f"{mode:<{width}}{s['ttft_p50_s'] * 1e3:>8.0f}ms{spread([t * 1e3 for t in ttfts], 0):>12}{speedup:>8.2f}x"
              f"{spread(speedups):>12}{s['kl_mean']:>10.4f}{spread(kls, 4):>16}{s['agree']:>7.0%}{s['f1']:>7.3f}"
              f"{worse:>18}")
    for mode, r in blended:
        s = summary[mode]
        if "recompute_cost" in s:
            low, high = s["recompute_cost_spread"]
            print(f"recompute cost of {mode}: (blend - naive) / full / r = {s['recompute_cost']:.2f} median "
                  f"({low:.2f}-{high:.2f}); (blend - naive) = {s['recompute_cost'] * r:.1%} of full prefill for "
                  f"{r:.0%} of the passage tokens")
    first = f"blend r={args.ratios[0]}"
    if args.reference:
        print(f"reference engine's own blend at r={args.ratios[0]}: KL mean "
              f"{statistics.mean(reference_kl):.4f} (vLLM's: {summary[first]['kl_mean']:.4f})")
    naive = summary["naive"]
    floor = 4.0 if not args.top_k or args.top_k >= 10 else 3.0  # issue #55: 3x at top-3, 4x at all 10 passages
    for mode in [first] + ([compare_mode] if args.compare else []):
        report_targets(mode, summary[mode], naive, floor, len(records))
    if args.json:
        settings = {"dtype": args.dtype, "selector": args.selector, "compare": args.compare, "top_k": args.top_k, "ratios": args.ratios,
                    "skip": args.skip, "questions": args.questions, "repeats": args.repeats}
        args.json.write_text(json.dumps({"host": isa_summary(), "settings": settings, "summary": summary,
                                         "records": records,
                                         "reference_blend_kl": reference_kl}))
    if args.plot:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.boxplot([[r["modes"][m]["ttft_s"] * 1e3 for r in records] for m in modes], tick_labels=modes)
        left.set_ylabel("TTFT (ms), vLLM CPU")
        right.boxplot([[r["modes"][m]["kl"] for r in records] for m in modes[2:]], tick_labels=modes[2:])
        right.set_ylabel("first-token KL vs full prefill")
        fig.suptitle(f"vLLM + kvstore on MuSiQue, {len(records)} questions, top-{args.top_k or 'all'} passages, "
                     f"{args.dtype}, blend selector {args.selector}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
