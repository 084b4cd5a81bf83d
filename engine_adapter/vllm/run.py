"""Run vLLM (CPU build) on token-id prompts, with or without kvstore, and write what happened as JSON.

    python -m engine_adapter.vllm.run --model DIR --prompts prompts.json --out result.json \\
        [--kvstore unix:/path/kvstore.sock] [--max-tokens 16] [--wait-stored 60]

``prompts.json`` is a list of token-id lists; each is generated greedily, one request at a time.
The result holds, per prompt, the new token ids, vLLM's ``num_cached_tokens`` (its own prefix-cache
hit plus kvstore's) and the wall time; with ``--wait-stored`` it also waits until the daemon holds
every full chunk of each prompt (the connector saves in the background) and reports the namespace
id, so a caller can check the keys against another engine's.

vLLM starts worker processes, so this runs as a script (``if __name__ == "__main__"``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def kv_transfer_config(address: str, **extra: object):
    """The ``KVTransferConfig`` that plugs kvstore into vLLM."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="engine_adapter.vllm.connector",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"address": address, **extra})


def wait_stored(llm, address: str, prompts: list[list[int]], timeout: float) -> tuple[str, list[int]]:
    """Poll the daemon until it holds every full chunk of each prompt; (namespace id hex, hits per prompt)."""
    from engine_adapter.client import KVStoreClient
    from engine_adapter.vllm.connector import ConnectorSettings, vllm_namespace
    from kvstore.keys import prefix_keys

    namespace = vllm_namespace(llm.llm_engine.vllm_config, ConnectorSettings(address=address))
    keys = [prefix_keys(namespace, prompt[:-1]) for prompt in prompts]
    deadline = time.monotonic() + timeout
    with KVStoreClient(address, shared_memory=False) as client:
        while True:
            hits = [client.lookup(k).hits if k else 0 for k in keys]
            if hits == [len(k) for k in keys] or time.monotonic() > deadline:
                return namespace.id.hex(), hits
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face folder (see engine_adapter.vllm.hf_folder)")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--kvstore", default=None, help="daemon address; without it vLLM runs alone")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn off vLLM's own prefix cache")
    parser.add_argument("--wait-stored", type=float, default=0.0, metavar="SECONDS",
                        help="after generating, wait up to this long for the daemon to hold every chunk")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len, enforce_eager=True,
              enable_prefix_caching=not args.no_prefix_caching,
              kv_transfer_config=kv_transfer_config(args.kvstore) if args.kvstore else None)
    result: dict = {"startup_s": time.perf_counter() - started, "outputs": []}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for prompt in prompts:
        start = time.perf_counter()
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        result["outputs"].append({"token_ids": list(output.outputs[0].token_ids),
                                  "text": output.outputs[0].text,
                                  "num_cached_tokens": output.num_cached_tokens,
                                  "seconds": time.perf_counter() - start})
    if args.kvstore and args.wait_stored > 0:
        result["namespace"], result["stored_chunks"] = wait_stored(llm, args.kvstore, prompts, args.wait_stored)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
