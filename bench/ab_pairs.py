"""A before/after comparison of `bench/daemon_throughput.py` between two revisions, in ABBA pairs.

On a shared, noisy host one run of each revision says little: the same code moves 10-30% from run
to run. This runs the benchmark alternately on an old revision (checked out into a temporary git
worktree, with the *current* benchmark copied in, so both sides measure the same things) and on
this tree, pair after pair in the order old-new, new-old, ..., and reports per figure the median
of each side, the median of the per-pair ratios new / old with a 95% bootstrap interval, and in
how many pairs the new side was lower. A ratio whose interval contains 1 is noise at this many pairs.

    python bench/ab_pairs.py efa84a7 --pairs 8 [--json out.json] [-- --clients 1 8 --rounds 7]

Everything after ``--`` goes to `bench/daemon_throughput.py` (default: a short run, see ``BENCH_ARGS``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path("bench") / "daemon_throughput.py"
#: The benchmark's files, copied into the old revision's worktree so that both sides run the same code.
BENCH_FILES = (BENCH, Path("bench") / "daemon_clients.py")
#: The short run the #13 comparisons used (about 50 s per run on 2 cores).
#: No remote rounds: revisions before the data channel (#42) have none to measure.
BENCH_ARGS = ["--clients", "1", "8", "--rounds", "7", "--lookup-calls", "50", "--get-passes", "1", "--remote-rounds", "0"]


def figures(run: dict) -> dict[str, float]:
    """One run's JSON -> {figure name: value}; GB/s and ratios (higher is better), latencies in ms."""
    out = {}
    for r in run["rows"]:
        name = f"{r['tier']} {r['transport']} {r['clients']}c {r['op']}"
        out[f"{name} GB/s"] = r["gbps"]
        out[f"{name} vs {r['baseline']}"] = r["ratio_slots"]
    for kind, latency in run["lookup_ms"].items():
        out[f"lookup {kind} p50 ms"] = latency["p50"]
        if "during puts" in kind or kind == "grpc paced, 1 client":  # the tail is the figure there
            out[f"lookup {kind} p99 ms"] = latency["p99"]
    return out


def bootstrap_median(ratios: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the median of ``ratios`` (percentile bootstrap)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def run_once(tree: Path, out: Path, bench_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, str(tree / BENCH), *bench_args, "--json", str(out)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree / BENCH} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    argv = sys.argv[1:]
    bench_args = BENCH_ARGS
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", help="the revision to compare against (any git revision)")
    parser.add_argument("--pairs", type=int, default=8, help="ABBA pairs (default 8; 2 runs each)")
    parser.add_argument("--json", metavar="PATH", help="also write every run's figures as JSON")
    args = parser.parse_args(argv)
    if args.pairs < 2:
        parser.error("--pairs must be at least 2")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on a plain kill too
    scratch = Path(tempfile.mkdtemp(prefix="kv-ab-"))
    old_tree = scratch / "old"
    try:
        added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree), args.old],
                               capture_output=True, text=True)
        if added.returncode:
            raise SystemExit(f"cannot check out {args.old!r}: {added.stderr.strip()}")
        for path in BENCH_FILES:
            shutil.copy(ROOT / path, old_tree / path)
        runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for pair in range(args.pairs):
            for side in (("old", "new") if pair % 2 == 0 else ("new", "old")):
                tree = old_tree if side == "old" else ROOT
                runs[side].append(figures(run_once(tree, scratch / f"{side}-{pair}.json", bench_args)))
                print(f"pair {pair + 1}/{args.pairs}: {side} done", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)

    print(f"{args.pairs} ABBA pairs: {args.old} (old) against this tree (new); bench/daemon_throughput.py "
          f"{' '.join(bench_args)}\n")
    print(f"{'figure':36} {'old':>8} {'new':>8} {'new/old':>8} {'95% CI':>13}  new lower")
    summary = {}
    for name in runs["old"][0]:
        ratios = [new[name] / old[name] for old, new in zip(runs["old"], runs["new"])]
        low, high = bootstrap_median(ratios)
        summary[name] = {"old": [r[name] for r in runs["old"]], "new": [r[name] for r in runs["new"]],
                         "ratio_median": statistics.median(ratios), "ci95": [low, high]}
        print(f"{name:36} {statistics.median(r[name] for r in runs['old']):8.3f} "
              f"{statistics.median(r[name] for r in runs['new']):8.3f} {statistics.median(ratios):8.2f} "
              f"[{low:.2f}-{high:.2f}]  {sum(r < 1 for r in ratios)}/{args.pairs}")
    print("\n(lookup rows are latencies: lower is better; every other row is higher-is-better)")
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old, "bench_args": bench_args, "figures": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
