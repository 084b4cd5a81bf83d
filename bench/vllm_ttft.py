"""vLLM time to first token on a ~4k-token document: cold, warm through kvstore, and vLLM's own
in-process prefix cache (the resident limit), each measured in the same run.

    .venv-vllm/bin/python bench/vllm_ttft.py [--repeats 3] [--json out.json]

Needs the vLLM CPU build (see .ci/run for the .venv-vllm recipe). Every vLLM run is a fresh process
(engine_adapter/vllm/run.py) with greedy decoding of one token, so its per-prompt wall time is
the time to first token:

- cold: a fresh vLLM with kvstore and an empty daemon (it stores the document's chunks);
- warm: another fresh vLLM process, the same prompt, hits from the daemon's CPU tier;
- resident: one vLLM process without kvstore, the prompt twice; the second hits vLLM's own cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.spawn import DaemonProcess  # noqa: E402


def vllm_run(folder: Path, model: Path, prompts: list[list[int]], address: str | None, tag: str) -> dict:
    prompts_file, out = folder / f"{tag}.prompts.json", folder / f"{tag}.out.json"
    prompts_file.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "engine_adapter.vllm.run", "--model", str(model), "--prompts", str(prompts_file),
           "--out", str(out), "--max-tokens", "1"]
    if address:
        cmd += ["--kvstore", address, "--wait-stored", "60"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000; vLLM max 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh daemons and processes per mode (default 3)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    from engine_adapter.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.prompts import document_prompt
    from engine_adapter.vllm.hf_folder import write_hf_folder

    sample = json.loads(resources.files("engine_adapter").joinpath("data/musique_sample.json").read_text())
    _, tokenizer = load_gguf(find_smollm2_gguf())
    context, question = document_prompt(tokenizer, sample["document"], sample["questions"][0]["question"])
    prompt = context[: args.tokens - len(question)] + question
    folder = Path(tempfile.mkdtemp(prefix="kvvllm-"))
    model = write_hf_folder(folder / "model")
    cold, warm, resident = [], [], []
    hits = {}
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}: cold, warm, resident ...", flush=True)
        with DaemonProcess.in_folder(folder / f"daemon{repeat}", cpu_capacity="2GiB", disk_path="") as daemon:
            first = vllm_run(folder, model, [prompt], daemon.address, f"cold{repeat}")
            second = vllm_run(folder, model, [prompt], daemon.address, f"warm{repeat}")
        own = vllm_run(folder, model, [prompt, prompt], None, f"resident{repeat}")
        cold.append(first["outputs"][0]["seconds"])
        warm.append(second["outputs"][0]["seconds"])
        resident.append(own["outputs"][1]["seconds"])
        hits = {"cold": first["outputs"][0]["num_cached_tokens"], "warm": second["outputs"][0]["num_cached_tokens"],
                "resident": own["outputs"][1]["num_cached_tokens"]}
        same = first["outputs"][0]["token_ids"] == second["outputs"][0]["token_ids"] == own["outputs"][1]["token_ids"]
    report = {"prompt_tokens": len(prompt), "cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
              "resident_s": statistics.median(resident), "cached_tokens": hits, "same_first_token": same}
    print(f"\nSmolLM2-135M (bf16) on the vLLM CPU build, {len(prompt)}-token prompt, median of {args.repeats}")
    print(f"{'mode':<28} {'TTFT':>8} {'cached tokens':>14} {'vs cold':>8}")
    for mode, key in (("cold (fresh vLLM)", "cold"), ("warm through kvstore (fresh)", "warm"),
                      ("vLLM prefix cache (resident)", "resident")):
        seconds = report[f"{key}_s"]
        print(f"{mode:<28} {seconds:>7.2f}s {hits[key]:>14} {report['cold_s'] / seconds:>7.1f}x")
    print(f"first token identical in all three: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
