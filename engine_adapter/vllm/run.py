"""Run vLLM (CPU build) on token-id prompts, with or without kvstore, and write what happened as JSON.

    python -m engine_adapter.vllm.run --model DIR --prompts prompts.json --out result.json \\
        [--kvstore unix:/path/kvstore.sock] [--max-tokens 16] [--wait-stored 60]

``prompts.json`` is a list of prompts, each a token-id list, ``{"prompt_token_ids": [...],
"kv_transfer_params": {...}}`` (e.g. a blend request, ``engine_adapter.vllm.blend.blend_request``)
or ``{"prompt": "text", ...}``, which vLLM tokenizes (e.g. passages marked with the connector's
``blend_separator``; the output then holds the ``prompt_token_ids``);
each is generated greedily, one request at a time (``--together``: all in one ``generate`` call, so
vLLM batches them). ``--logprobs`` adds the first new token's log-probabilities over the whole
vocabulary; vLLM then computes them for every new token, so those requests skip vLLM's
detokenizer (which would decode the whole vocabulary per token, about a second each here) and
their text is decoded once at the end.
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


def kv_transfer_config(address: str, module: str = "engine_adapter.vllm.connector", role: str = "kv_both",
                       **extra: object):
    """The ``KVTransferConfig`` that plugs kvstore into vLLM (``role``: kv_both, or kv_producer /
    kv_consumer for prefill/decode through the cache)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path=module,
                            kv_role=role, kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"address": address, **extra})


def wait_stored(llm, address: str, prompts: list[list[int]], timeout: float) -> tuple[str, list[int]]:
    """Poll the daemon until it holds every piece (full chunks and tail) of each prompt;
    (namespace id hex, pieces stored per prompt)."""
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.vllm.connector import vllm_namespace
    from engine_adapter.vllm.settings import ConnectorSettings
    from kvstore.keys import paged_prefix_keys

    config = llm.llm_engine.vllm_config
    namespace = vllm_namespace(config, ConnectorSettings(address=address))
    keys = [paged_prefix_keys(namespace, prompt[:-1], config.cache_config.block_size)[0] for prompt in prompts]
    deadline = time.monotonic() + timeout
    with KVStoreClient(address, shared_memory=False) as client:
        while True:
            hits = [client.lookup(k).hits if k else 0 for k in keys]
            if hits == [len(k) for k in keys] or time.monotonic() > deadline:
                return namespace.id.hex(), hits
            time.sleep(0.05)


def token_ids(prompt: list[int] | dict) -> list[int]:
    """A prompt's token ids: the prompt itself, or its ``prompt_token_ids``."""
    return prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face folder (see engine_adapter.vllm.hf_folder)")
    parser.add_argument("--prompts", required=True,
                        help="JSON file: a list of prompts, each a token-id list, {\"prompt_token_ids\": [...], "
                             "\"kv_transfer_params\": {...}} or {\"prompt\": \"text\", ...}")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--kvstore", default=None, help="daemon address; without it vLLM runs alone")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="vLLM's model and KV dtype (default bfloat16; float32 on a CPU without native bf16)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn off vLLM's own prefix cache")
    parser.add_argument("--together", action="store_true", help="submit every prompt at once (one batch)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--num-pages", type=int, default=None, help="vLLM KV pages (num_gpu_blocks_override)")
    parser.add_argument("--connector-module", default="engine_adapter.vllm.connector",
                        help="module holding KVStoreConnector (tests inject faults with a subclass)")
    parser.add_argument("--kv-extra", default="{}", help="JSON: more kv_connector_extra_config keys")
    parser.add_argument("--kv-role", default="kv_both", choices=("kv_both", "kv_producer", "kv_consumer"),
                        help="kv_producer: a prefill instance (stores before returning); kv_consumer: decode (loads only)")
    parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="publish vLLM's KV events (its own and kvstore's) on this ZMQ endpoint, e.g. tcp://*:5557")
    parser.add_argument("--logprobs", action="store_true",
                        help="also write the first new token's log-probabilities over the whole vocabulary")
    parser.add_argument("--wait-stored", type=float, default=0.0, metavar="SECONDS",
                        help="after generating, wait up to this long for the daemon to hold every chunk")
    parser.add_argument("--wait-each", type=float, default=0.0, metavar="SECONDS",
                        help="after each request, wait up to this long for the daemon to hold its chunks "
                             "(untimed), so a repeat in this process can hit them")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TextPrompt, TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    extra: dict = {"num_gpu_blocks_override": args.num_pages} if args.num_pages else {}
    if args.kv_events:
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events)
    transfer = (kv_transfer_config(args.kvstore, args.connector_module, args.kv_role, **json.loads(args.kv_extra))
                if args.kvstore else None)
    if args.logprobs:
        extra["max_logprobs"] = -1
        extra["disable_log_stats"] = False  # vLLM's own per-request first-token latency, in the output
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              enable_prefix_caching=not args.no_prefix_caching, kv_transfer_config=transfer, **extra)
    result: dict = {"startup_s": time.perf_counter() - started, "outputs": []}
    logprobs = {"logprobs": -1, "flat_logprobs": True} if args.logprobs else {}

    def request(prompt) -> tuple:
        transfer = prompt.get("kv_transfer_params") if isinstance(prompt, dict) else None
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos,
                                extra_args={"kv_transfer_params": transfer} if transfer else None,
                                detokenize=not args.logprobs, **logprobs)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return TextPrompt(prompt=prompt["prompt"]), params
        return TokensPrompt(prompt_token_ids=token_ids(prompt)), params

    tokenizer = llm.get_tokenizer()
    batches = [prompts] if args.together else [[prompt] for prompt in prompts]
    prompt_ids: list[list[int]] = []  # as vLLM saw them (text prompts tokenized)
    for batch in batches:
        start = time.perf_counter()
        requests = [request(prompt) for prompt in batch]
        outputs = llm.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False)
        for prompt, output in zip(batch, outputs):
            prompt_ids.append(list(output.prompt_token_ids))
            new_tokens = list(output.outputs[0].token_ids)
            text = tokenizer.decode(new_tokens, skip_special_tokens=True) if args.logprobs else output.outputs[0].text
            done = {"token_ids": new_tokens, "text": text,
                    "num_cached_tokens": output.num_cached_tokens, "seconds": time.perf_counter() - start}
            if isinstance(prompt, dict) and "prompt" in prompt:
                done["prompt_token_ids"] = prompt_ids[-1]
            metrics = getattr(output, "metrics", None)
            if getattr(metrics, "first_token_latency", 0):
                done["first_token_latency_s"] = metrics.first_token_latency  # vLLM's own, before detokenizing
            if args.logprobs:
                first = output.outputs[0].logprobs  # FlatLogprobs; position 0 is the first new token
                begin, end = first.start_indices[0], first.end_indices[0]
                dense = [float("-inf")] * llm.llm_engine.model_config.get_vocab_size()
                for token, value in zip(first.token_ids[begin:end], first.logprobs[begin:end]):
                    dense[token] = value
                done["first_logprobs"] = dense
            result["outputs"].append(done)
        if args.kvstore and args.wait_each > 0:
            wait_stored(llm, args.kvstore, prompt_ids[-len(batch):], args.wait_each)
    if args.kvstore and args.wait_stored > 0:
        result["namespace"], result["stored_chunks"] = wait_stored(llm, args.kvstore, prompt_ids, args.wait_stored)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
