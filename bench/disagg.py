"""Prefill/decode disaggregation through kvstore: the decode instance's time to first token after
a prefill instance stored the prompt's KV, against a cold prefill of the same prompt, same run.

    .venv-vllm/bin/python bench/disagg.py [--tokens 4000] [--repeats 1] [--json out.json]

Needs the vLLM CPU build (.venv-vllm, see .ci/run) with boto3 and moto[server] (the shared bucket).
Every vLLM instance is a fresh process (engine_adapter/vllm/run.py); a request's wall time is its
TTFT (vLLM's start-up excluded). Per repeat:

- cold:   vLLM without kvstore, the prompt once (a full prefill);
- same:   one daemon; a kv_producer instance prefills (one token, stores before returning), then a
          kv_consumer instance decodes: its TTFT is the decode side's after a remote prefill;
- bucket: two daemons sharing an S3 bucket (moto's server on 127.0.0.1); the producer's saves are
          durable (in the bucket when its request returns); the consumer's daemon finds them there.

The KV-event side of scale-out (events per second, Put throughput with and without a subscriber)
is bench/events.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.vllm_ttft import document_setup, vllm_run  # noqa: E402
from kvstore.spawn import DaemonProcess  # noqa: E402
from tests.conftest import MotoServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000; vLLM max 4096)")
    parser.add_argument("--repeats", type=int, default=1, help="repeats, each with fresh daemons and processes")
    parser.add_argument("--json", metavar="PATH", help="write every repeat's figures as JSON")
    args = parser.parse_args()

    prompt, folder, model = document_setup(args.tokens, 1, "kvdisagg-")
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    moto = MotoServer(folder).start()
    rows = []
    try:
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}: cold, same host, shared bucket ...", flush=True)
            cold = vllm_run(folder, model, [prompt], None, f"cold{repeat}")["outputs"][0]
            with DaemonProcess.in_folder(folder / f"one{repeat}", cpu_capacity="2GiB", disk_path="") as one:
                same_p = vllm_run(folder, model, [prompt], one.address, f"same_p{repeat}", "--kv-role", "kv_producer")
                same_d = vllm_run(folder, model, [prompt], one.address, f"same_d{repeat}", "--kv-role", "kv_consumer")
            bucket = f"disagg-{repeat}"
            moto.client().create_bucket(Bucket=bucket)
            s3 = {"s3_endpoint": moto.url, "s3_bucket": bucket, "disk_path": "", "cpu_capacity": "2GiB"}
            with DaemonProcess.in_folder(folder / f"p{repeat}", **s3) as prefill, \
                    DaemonProcess.in_folder(folder / f"d{repeat}", **s3) as decode:
                cross_p = vllm_run(folder, model, [prompt], prefill.address, f"cross_p{repeat}", "--kv-role",
                                   "kv_producer", "--kv-extra", json.dumps({"save_mode": "durable"}))
                cross_d = vllm_run(folder, model, [prompt], decode.address, f"cross_d{repeat}", "--kv-role",
                                   "kv_consumer")
            outs = {"cold": cold, "same_prefill": same_p["outputs"][0], "same_decode": same_d["outputs"][0],
                    "bucket_prefill": cross_p["outputs"][0], "bucket_decode": cross_d["outputs"][0]}
            row = {"repeat": repeat, **{f"{k}_s": v["seconds"] for k, v in outs.items()},
                   "cached_tokens": {k: v["num_cached_tokens"] for k, v in outs.items()},
                   "first_tokens": {k: v["token_ids"][0] for k, v in outs.items()}}
            row["same_first_token"] = len(set(row["first_tokens"].values())) == 1
            rows.append(row)
            print(f"  cold {row['cold_s']:.2f}s  decode after prefill: same host {row['same_decode_s']:.3f}s, "
                  f"shared bucket {row['bucket_decode_s']:.3f}s  first token same: {row['same_first_token']}", flush=True)
    finally:
        moto.stop()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"\nSmolLM2-135M (bf16), vLLM CPU build, {len(prompt)}-token prompt, {args.repeats} repeats (median)")
    print(f"{'mode':<42} {'TTFT':>9} {'cached':>7} {'vs cold':>8}")
    cached = rows[-1]["cached_tokens"]
    for key, label in (("cold", "cold prefill (vLLM alone)"), ("same_prefill", "prefill instance (stores, same host)"),
                       ("same_decode", "decode instance, same host"),
                       ("bucket_prefill", "prefill instance (durable, shared bucket)"),
                       ("bucket_decode", "decode instance, other daemon + bucket")):
        print(f"{label:<42} {median(key + '_s'):>8.3f}s {cached[key]:>7} {median('cold_s') / median(key + '_s'):>7.1f}x")
    print(f"first token identical in every mode and repeat: {all(r['same_first_token'] for r in rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"prompt_tokens": len(prompt), "repeats": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
