"""vLLM time to first token on a ~4k-token document: cold, warm through kvstore (in a fresh process
and in an already-running one), and vLLM's own resident prefix cache, each measured in every repeat.

    .venv-vllm/bin/python bench/vllm_ttft.py [--repeats 3] [--json out.json]
    python bench/vllm_ttft.py --copy-only --layout all [--json copy.json]   # no vLLM needed

Needs the vLLM CPU build (see .ci/run for the .venv-vllm recipe). vLLM runs as fresh processes
(engine_adapter/vllm/run.py), greedy, one new token, so a request's wall time is its time to first
token (vLLM's own start-up is not in it). Per repeat, with a fresh daemon (CPU tier):

- running:  one vLLM process with kvstore and its own prefix cache off: the prompt cold (it stores
            the prompt's chunks and tail), then again once stored: a warm hit from kvstore in an
            already-running process;
- fresh:    a new vLLM process with kvstore: the same prompt, warm from the daemon;
- resident: one vLLM process without kvstore: the prompt cold, then again: vLLM's own prefix cache.

The first token of every request of every repeat is checked against the cold one of vLLM without
kvstore. Where a warm request's time goes, from the connector's one-time log lines (connection and
warm-up before the first request; the first hit's lookup, lease, Gets and page writes), is printed
for the fresh and the running process side by side: what the connector does before a request is not
in its TTFT, and the rest of the TTFT is vLLM's (scheduling, the forward of the last tokens,
sampling, output). Then the page copy of a load (kvstore's native page writer, as the connector runs it on
CPU, beside vLLM's own cache-write op) is timed against a plain memcpy of the same bytes, in this
process (``--copy-only``: that alone; ``--layout NAME`` or ``all`` forces vLLM's other page layouts,
the AMX one included, on any host, without vLLM). The report starts with the host's ISA flags, and
every figure has its spread (min-max over repeats, or over the copy's rounds).

Targets (issue #55): running <= 1.3x resident, fresh <= 1.5x resident, page copy <= 1.5x memcpy
(every layout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.host_isa import isa_line, isa_summary  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402

TARGETS = {"running_vs_resident": 1.3, "fresh_vs_resident": 1.5, "copy_vs_memcpy": 1.5}
LAYOUTS = ("kt_halves", "halves", "split", "amx")  # kernels/page_copy_ref.py's PLANE_LAYOUTS


def spread(values: list[float], digits: int = 2) -> str:
    """``min-max`` of values, for a figure's spread over repeats or rounds."""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def document_setup(tokens: int, question: int, prefix: str) -> tuple[list[int], Path, Path]:
    """A ``tokens``-long document prompt (the bundled MuSiQue sample, question ``question`` last),
    a scratch folder named ``prefix...``, and the SmolLM2 HF folder vLLM loads, written in it."""
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.reference.prompts import document_prompt
    from engine_adapter.vllm.hf_folder import write_hf_folder

    sample = json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())
    _, tokenizer = load_gguf(find_smollm2_gguf())
    context, asked = document_prompt(tokenizer, sample["document"], sample["questions"][question]["question"])
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    return context[: tokens - len(asked)] + asked, folder, write_hf_folder(folder / "model")


def vllm_env() -> dict[str, str]:
    """The environment of every vLLM process the benches start: the same CPU cores for each.

    vLLM's CPU build binds its OpenMP threads itself ("auto") and reserves cores for its other
    processes, a different number with a KV connector than without one: on a 2-core host vLLM alone
    computes on 1 core and vLLM with kvstore on 2, so the baseline rows (cold, resident) ran on
    half the cores of the rows they are compared with. Every run gets every allowed core unless
    VLLM_CPU_OMP_THREADS_BIND is set."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return {"VLLM_CPU_OMP_THREADS_BIND": cores, **os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_run(folder: Path, model: Path, prompts: list[list[int]], address: str | None, tag: str,
             *args: str) -> dict:
    prompts_file, out, log = folder / f"{tag}.prompts.json", folder / f"{tag}.out.json", folder / f"{tag}.log"
    prompts_file.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "engine_adapter.vllm.run", "--model", str(model), "--prompts", str(prompts_file),
           "--out", str(out), "--max-tokens", "1", *args]
    if address:
        cmd += ["--kvstore", address, "--wait-each", "60"]
    with open(log, "wb") as log_file:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=vllm_env())
    if proc.returncode:
        sys.exit(f"vLLM run {tag} failed ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    result = json.loads(out.read_text())
    result["log"] = log.read_text()
    return result


def page_writes(log: str) -> tuple[float, float]:
    """(MB, ms) of the connector's page writes, from its shutdown line."""
    found = re.search(r"loaded \d+ pieces \(([\d.]+) MB, page writes ([\d.]+) ms", log)
    return (float(found.group(1)), float(found.group(2))) if found else (0.0, 0.0)


# The connector's one-time log lines (engine_adapter/vllm/connector.py, scheduler.py, worker.py):
# a line's start, and the phase each "name N ms" after it is; "" takes the name as it is.
_FIRST_HIT_LINES = (
    (r"KVStoreConnector \(WORKER\): connected to the daemon in", "worker connect"),
    (r"KVStoreConnector \(SCHEDULER\): connected to the daemon in", "scheduler connect"),
    (r"KVStoreConnector worker: load path warmed before the first request", "warm-up "),
    (r"KVStoreConnector scheduler: lookups warmed before the first request", "warm-up "),
    (r"KVStoreConnector scheduler: first hit:", ""),
    (r"KVStoreConnector worker: first load: \d+ pieces in [\d.]+ ms", ""),
)
BEFORE_REQUEST = ("worker connect", "scheduler connect", "warm-up Get", "warm-up page write", "warm-up lookup",
                  "warm-up lease")
IN_REQUEST = ("keys", "lookup", "lease", "Gets", "page writes")


def first_hit_costs(log: str, ttft_s: float) -> dict[str, float]:
    """Milliseconds of each phase of a process's first hit, from the connector's log lines (a
    phase without its line is left out), and ``vLLM and the rest``: the TTFT minus the phases in
    the request."""
    costs: dict[str, float] = {}
    for start, phase in _FIRST_HIT_LINES:
        line = re.search(start + r"(.*)", log)
        if line is None:
            continue
        for name, ms in re.findall(r"([A-Za-z ]*?) ?([\d.]+) ms", line.group(1)):
            costs[phase if phase and not phase.endswith(" ") else phase + name.strip()] = float(ms)
    costs["vLLM and the rest"] = ttft_s * 1e3 - sum(costs.get(name, 0.0) for name in IN_REQUEST)
    return costs


def print_first_hit(repeats: list[dict]) -> None:
    """The fresh and the running process's first hit, phase by phase (medians over repeats)."""
    print("\nwhere the first warm request's time goes (ms, medians (min-max); from the connector's log lines):")
    print(f"  {'phase':<40} {'fresh':>18} {'running':>18}")
    sections = (("before the request (not in TTFT)", BEFORE_REQUEST),
                ("in the request (TTFT)", (*IN_REQUEST, "vLLM and the rest")))
    for title, names in sections:
        print(f"  {title}")
        for name in names:
            values = {mode: [r[f"{mode}_first_hit"][name] for r in repeats if name in r[f"{mode}_first_hit"]]
                      for mode in ("fresh", "running")}
            if not any(values.values()):
                continue
            cells = [f"{statistics.median(v):>6.1f} ({spread(v, 1):>9})" if v else f"{'-':>18}"
                     for v in values.values()]
            print(f"    {name:<38} {' '.join(cells)}")


def copy_benchmark(tokens: int, rounds: int = 9, layout_name: str | None = None) -> dict:
    """The connector's load copy on SmolLM2's shapes (30 layers, 3 KV heads, head_dim 64, 128-token
    pages, 256-token blocks on an irregular page table), against a memcpy of the same bytes.

    ``layout_name`` None: the page layout vLLM's CPU backend picks on this host, measured with its
    own op, and the paths the connector may take: kvstore's native page writer (its path), vLLM's
    cache-write op with a slot mapping (its fallback) and the per-element layout path (the
    reference). A name (``kt_halves``, ``halves``, ``split``, ``amx``): that layout forced, with no
    vLLM needed (a layout is memory, not instructions: the AMX layout benchmarks on any host), and
    vLLM's op beside it where vLLM is installed and writes that layout. Both name the native writer
    with AVX2 (``native``) and without (``native_sse2``, the path of a CPU without it), and time a
    save's read of the same blocks back out of the native path's pages (``save_read``,
    `PageWriter.read`, a new block each as in the connector).

    The ceiling is libc's ``memmove`` of the same bytes, on one thread as the writer. Each round
    times the memmove and every path's write of all the blocks in turn (in reverse order every
    other round), each path with caches and blocks of its own (interleaved block by block, a path
    read blocks another had just pulled into the caches and paid for lines another had left dirty:
    the old writer looked 1.1-1.8x a memcpy that way, 2-3x alone). Ratios are per round, with
    their spread (min-max) over rounds, in wall-clock time and, for the one-thread paths, in this
    thread's CPU time (``time.thread_time``: a shared host's other jobs preempt a copy, which
    wall-clock time counts and CPU time does not; memory stalls count in both). torch's ``copy_`` of the same bytes (its threads) comes at
    each round's end, then a pause (its OpenMP threads spin after it, and slowed whatever ran next
    2-10x on the busy 2-core VM); the paths' ratios to it are in the JSON (``*_vs_torch_copy``)."""
    import ctypes

    import torch

    from engine_adapter.vllm.layout import PagedKV, PagedSpan, PageLayout, measure_page_layout
    from kernels.page_copy import PageWriter, avx2_paths

    layers, heads, head_dim, page, chunk = 30, 3, 64, 128, 256
    write, isa = None, None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from engine_adapter.vllm.layout import cpu_cache_write
        isa = _get_attn_isa(torch.bfloat16, page, head_dim)
    except ImportError:
        if layout_name is None:
            raise SystemExit("the copy benchmark of vLLM's own layout needs vLLM; --layout NAME forces one without")
    if layout_name is None:
        write = cpu_cache_write(isa)
        layout = measure_page_layout(write, heads, page, head_dim, torch.bfloat16)
    else:
        layout = PageLayout.named(layout_name, page, head_dim)
        isa = {"kt_halves": "vec", "amx": "amx"}.get(layout_name) if isa is not None else None
        if isa is not None:  # vLLM's op for that layout's ISA, where it writes exactly this layout here
            op = cpu_cache_write(isa)
            write = op if measure_page_layout(op, heads, page, head_dim, torch.bfloat16).name() == layout_name else None
    pages = tokens // page + 8
    chunks = tokens // chunk
    blocks = [torch.randn(layers, 2, heads, chunk, head_dim).to(torch.bfloat16) for _ in range(chunks)]
    order = torch.randperm(pages)[: chunks * chunk // page].tolist()  # an irregular page table
    spans = [PagedSpan(tuple(order[c * chunk // page : (c + 1) * chunk // page]), 0, chunk) for c in range(chunks)]
    nbytes = sum(b.numel() * b.element_size() for b in blocks)
    source, target = torch.randn(nbytes // 2).to(torch.bfloat16), torch.empty(nbytes // 2, dtype=torch.bfloat16)

    def own_memory() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Caches and blocks of a path's own: no path reads what another left in the caches, nor
        pays for the lines another left dirty."""
        return ([torch.zeros(pages, heads, page, 2 * head_dim, dtype=torch.bfloat16) for _ in range(layers)],
                [b.clone() for b in blocks])

    paths = {}  # name -> (PagedKV, its blocks)
    if layout.name() is not None:
        for name, simd in (("native", True), ("native_sse2", False)):
            caches, own = own_memory()
            paths[name] = PagedKV(caches, layout, heads, page, native=PageWriter(caches, layout.name(), simd=simd)), own
    if write is not None:
        caches, own = own_memory()
        paths["op"] = PagedKV(caches, layout, heads, page, write=write), own
    if layout_name is None:
        caches, own = own_memory()
        paths["layout"] = PagedKV(caches, layout, heads, page), own
    copies = {"memmove": lambda: ctypes.memmove(target.data_ptr(), source.data_ptr(), nbytes)}
    copies.update({name: (lambda paged=paged, own=own: [paged.scatter(b, s) for b, s in zip(own, spans)])
                   for name, (paged, own) in paths.items()})
    single_thread = [name for name in paths if name.startswith("native")]  # whose CPU time is this thread's
    timed = list(paths)
    if "native" in paths:  # a save's read of the blocks back out of the pages (PageWriter.read, one thread)
        reader = paths["native"][0]
        copies["save_read"] = lambda: [reader.native.read(reader.slots(s)) for s in spans]
        single_thread.append("save_read")
        timed.append("save_read")
    per_round = []
    for round_ in range(rounds + 1):  # round 0 warms up (first touch of every page)
        times = {}
        # every side in turn, in reverse order every other round; vLLM's op and the layout path
        # run on OpenMP threads, which spin on the other cores for a while after each parallel region
        for name in (list(copies) if round_ % 2 == 0 else list(copies)[::-1]):
            began, began_cpu = time.perf_counter(), time.thread_time()
            copies[name]()
            times[f"{name}_ms"] = (time.perf_counter() - began) * 1e3
            times[f"{name}_cpu_ms"] = (time.thread_time() - began_cpu) * 1e3
        # torch's copy_ of the same bytes at the round's end, then a pause: its OpenMP threads spin
        # for a while after it, on the cores the timed copies run on
        began = time.perf_counter()
        target.copy_(source)
        times["torch_copy_ms"] = (time.perf_counter() - began) * 1e3
        time.sleep(0.2)
        times["memcpy_ms"] = times["memmove_ms"]
        for name in timed:
            times[f"{name}_vs_memcpy"] = times[f"{name}_ms"] / times["memcpy_ms"]
            times[f"{name}_vs_torch_copy"] = times[f"{name}_ms"] / times["torch_copy_ms"]
            if name in single_thread:
                times[f"{name}_cpu_vs_memcpy"] = times[f"{name}_cpu_ms"] / times["memmove_cpu_ms"]
        if round_:
            per_round.append(times)
    median = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    spread = {key: [min(r[key] for r in per_round), max(r[key] for r in per_round)] for key in per_round[0]}
    # each side's fastest round against memmove's: what a copy costs when no other job preempts it
    best = {name: spread[f"{name}_ms"][0] / spread["memmove_ms"][0] for name in timed}
    connector = "native" if "native" in paths else "op"  # what the connector runs (native_copy: true)
    cpu = f"{connector}_cpu_vs_memcpy"
    return {"isa": isa, "layout": layout.name(), "forced": layout_name is not None, "mb": nbytes / 1e6,
            "threads": torch.get_num_threads(), "avx2_paths": avx2_paths(), "rounds": per_round, **median,
            "spread": spread, "best_vs_memcpy": best, "connector_path": connector,
            "copy_vs_memcpy": median[f"{connector}_vs_memcpy"],
            "copy_vs_memcpy_spread": spread[f"{connector}_vs_memcpy"],
            "copy_cpu_vs_memcpy": median.get(cpu), "copy_cpu_vs_memcpy_spread": spread.get(cpu)}


def print_copy(copy: dict) -> None:
    labels = {"native": "kvstore's native page writer", "native_sse2": "  the same without AVX2 (SSE2)",
              "op": "vLLM's cache-write op", "layout": "per-element layout path",
              "save_read": "a save's read back (native, 1 thread)"}
    how = "forced" if copy["forced"] else f"vLLM's pick here, ISA {copy['isa']}"
    print(f"page copy of {copy['mb']:.1f} MB into the {copy['layout']} page layout ({how}; {len(copy['rounds'])} "
          f"rounds; medians, ratios per round (min-max); fastest round against memmove's fastest):")
    for name, label in (("memmove", "memcpy: libc memmove (1 thread)"),
                        ("torch_copy", f"  torch copy_ ({copy['threads']} threads)")):
        low, high = copy["spread"][f"{name}_ms"]
        print(f"  {label:<36} {copy[name + '_ms']:>7.1f} ms ({low:.1f}-{high:.1f})")
    for name, label in labels.items():
        if f"{name}_ms" in copy:
            mark = "  <- the connector's path" if name == copy["connector_path"] else ""
            low, high = copy["spread"][f"{name}_vs_memcpy"]
            cpu = ""
            if f"{name}_cpu_vs_memcpy" in copy:
                c_low, c_high = copy["spread"][f"{name}_cpu_vs_memcpy"]
                cpu = f"; CPU time {copy[name + '_cpu_vs_memcpy']:.2f}x ({c_low:.2f}-{c_high:.2f})"
            print(f"  {label:<36} {copy[name + '_ms']:>7.1f} ms  {copy[name + '_vs_memcpy']:>5.2f}x memcpy "
                  f"({low:.2f}-{high:.2f}; fastest rounds {copy['best_vs_memcpy'][name]:.2f}x{cpu}){mark}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000; vLLM max 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh daemons and processes per mode (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write every repeat's figures as JSON")
    parser.add_argument("--layerwise", action="store_true",
                        help="also time the running-process warm request with layer-wise loading")
    parser.add_argument("--copy-only", action="store_true",
                        help="only the page copy against memcpy (seconds, no vLLM process)")
    parser.add_argument("--layout", choices=(*LAYOUTS, "all"),
                        help="with --copy-only: force this page layout (or each), no vLLM needed; default: "
                             "the one vLLM's CPU backend picks here")
    parser.add_argument("--rounds", type=int, default=9, help="page copy rounds (default 9)")
    args = parser.parse_args()
    if args.layout and not args.copy_only:
        parser.error("--layout goes with --copy-only (the full run copies into the layout vLLM picks)")
    print(isa_line(), flush=True)
    if args.copy_only:
        names = LAYOUTS if args.layout == "all" else [args.layout]
        copies = {}
        for name in names:
            copy = copies[name or "vllm"] = copy_benchmark(args.tokens // 256 * 256, args.rounds, name)
            print_copy(copy)
        for name, copy in copies.items():
            value = copy["copy_vs_memcpy"]
            met, cpu = value <= TARGETS["copy_vs_memcpy"], copy["copy_cpu_vs_memcpy"]
            cpu_text = "" if cpu is None else (f"; CPU time {cpu:.2f} ({spread(copy['copy_cpu_vs_memcpy_spread'])}) "
                                               f"{'met' if cpu <= TARGETS['copy_vs_memcpy'] else 'MISSED'}")
            print(f"target copy_vs_memcpy <= {TARGETS['copy_vs_memcpy']} ({copy['layout']}): wall {value:.2f} "
                  f"({spread(copy['copy_vs_memcpy_spread'])}) {'met' if met else 'MISSED'}{cpu_text}")
        if args.json:
            Path(args.json).write_text(json.dumps({"host": isa_summary(), "copies": copies, "targets": TARGETS},
                                                  indent=2))
        return 0

    prompt, folder, model = document_setup(args.tokens, 0, "kvvllm-")
    repeats = []
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}: running, fresh, resident ...", flush=True)
        with DaemonProcess.in_folder(folder / f"daemon{repeat}", cpu_capacity="2GiB", disk_path="") as daemon:
            running = vllm_run(folder, model, [prompt, prompt], daemon.address, f"running{repeat}",
                               "--no-prefix-caching")
            fresh = vllm_run(folder, model, [prompt], daemon.address, f"fresh{repeat}")
            if args.layerwise:  # the daemon holds the prompt now: both requests are warm
                layerwise = vllm_run(folder, model, [prompt, prompt], daemon.address, f"layerwise{repeat}",
                                     "--no-prefix-caching", "--kv-extra", json.dumps({"layerwise": True}))
        resident = vllm_run(folder, model, [prompt, prompt], None, f"resident{repeat}")
        outputs = {"cold": running["outputs"][0], "running": running["outputs"][1], "fresh": fresh["outputs"][0],
                   "plain_cold": resident["outputs"][0], "resident": resident["outputs"][1]}
        if args.layerwise:
            outputs["running_layerwise"] = layerwise["outputs"][1]
        first = {mode: out["token_ids"][0] for mode, out in outputs.items()}
        mb, ms = page_writes(fresh["log"])
        row = {"repeat": repeat, **{f"{mode}_s": out["seconds"] for mode, out in outputs.items()},
               "cached_tokens": {mode: out["num_cached_tokens"] for mode, out in outputs.items()},
               "first_tokens": first, "same_first_token": len(set(first.values())) == 1,
               "fresh_page_writes_mb": mb, "fresh_page_writes_ms": ms,
               "fresh_first_hit": first_hit_costs(fresh["log"], outputs["fresh"]["seconds"]),
               "running_first_hit": first_hit_costs(running["log"], outputs["running"]["seconds"])}
        row["running_vs_resident"] = row["running_s"] / row["resident_s"]
        row["fresh_vs_resident"] = row["fresh_s"] / row["resident_s"]
        repeats.append(row)
        print(f"  cold {row['cold_s']:.2f}s  running {row['running_s']:.3f}s  fresh {row['fresh_s']:.3f}s  "
              f"resident {row['resident_s']:.3f}s  first token same: {row['same_first_token']}", flush=True)
    copy = copy_benchmark(len(prompt) // 256 * 256, args.rounds)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in repeats)

    def values(key: str) -> list[float]:
        return [r[key] for r in repeats]

    print(f"\nSmolLM2-135M (bf16) on the vLLM CPU build, {len(prompt)}-token prompt, {args.repeats} repeats "
          f"(medians; min-max over repeats; 'vs resident' per repeat)")
    print(f"{'mode':<40} {'TTFT':>8} {'spread':>13} {'cached':>7} {'vs resident':>12} {'spread':>11}")
    last = repeats[-1]["cached_tokens"]
    for mode, label in (("cold", "cold (kvstore, stores)"), ("plain_cold", "cold (vLLM alone)"),
                        ("running", "warm via kvstore, running process"), ("fresh", "warm via kvstore, fresh process"),
                        ("running_layerwise", "warm via kvstore, running, layer-wise"),
                        ("resident", "vLLM's own prefix cache (resident)")):
        if mode not in last:
            continue
        ratios = [r[f"{mode}_s"] / r["resident_s"] for r in repeats]
        print(f"{label:<40} {median(mode + '_s'):>7.3f}s {spread(values(mode + '_s'), 3):>13} {last[mode]:>7} "
              f"{statistics.median(ratios):>11.2f}x {spread(ratios):>11}")
    print(f"first token identical in every mode and repeat: {all(r['same_first_token'] for r in repeats)}")
    mb, ms = values("fresh_page_writes_mb"), values("fresh_page_writes_ms")
    print(f"fresh process's page writes: {statistics.median(ms):.1f} ms ({spread(ms, 1)}) for "
          f"{statistics.median(mb):.1f} MB")
    print_first_hit(repeats)
    print_copy(copy)
    checks = {"running_vs_resident": (median("running_vs_resident"), values("running_vs_resident")),
              "fresh_vs_resident": (median("fresh_vs_resident"), values("fresh_vs_resident")),
              "copy_vs_memcpy": (copy["copy_vs_memcpy"], copy["copy_vs_memcpy_spread"])}
    for name, (value, each) in checks.items():
        print(f"target {name} <= {TARGETS[name]}: {value:.2f} ({spread(each)}) "
              f"{'met' if value <= TARGETS[name] else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"host": isa_summary(), "prompt_tokens": len(prompt), "repeats": repeats,
                                               "copy": copy, "medians": {k: v for k, (v, _) in checks.items()},
                                               "targets": TARGETS}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
