"""The serving benchmark's processes and client (bench/serving.py): vLLM's OpenAI-compatible server
as a child process group, Prometheus text scraped from it and from the kvstore daemon, the
connector's trace file, and the streaming client that plays a workload at its arrival times.

httpx is imported where it is used: the workload and summary tests run under the main Python,
which has neither vLLM nor httpx.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from serving_workload import Turn, Workload

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "engine_adapter" / "vllm" / "settings.py"
SERVED_NAME = "smollm2"
PAGE_TOKENS = 128  # vLLM's CPU backend pages (its log: 64 blocks = "CPU KV cache size: 8,192 tokens")
GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_settings() -> set[str]:
    """The ``kv_connector_extra_config`` keys this tree's connector accepts (its ConnectorSettings
    fields, read from the source: unknown keys fail vLLM's start, and importing it needs vLLM)."""
    tree = ast.parse(SETTINGS.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ConnectorSettings":
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return set()


def transfer_config(address: str, trace_file: Path | None) -> dict:
    """The KVStoreConnector config (engine_adapter/vllm/run.py ``kv_transfer_config``, as JSON)."""
    extra: dict[str, object] = {"address": address}
    if trace_file is not None:
        extra["trace_file"] = str(trace_file)
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine_adapter.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token: layers x 2 x kv heads x head dim x dtype bytes."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server: its own KV pages, and kvstore's connector config if any."""

    model_dir: Path
    pages: int
    max_model_len: int
    kv_cache_gib: int           # VLLM_CPU_KVCACHE_SPACE: what vLLM allocates; ``pages`` of it are used
    transfer: dict | None


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group (vLLM starts an
    engine core and workers); ``stop`` ends the whole group. The ``vllm`` script itself fails in
    this venv (the distribution is named vllm-cpu, its version lookup raises)."""

    def __init__(self, spec: ServerSpec, log_path: Path, env: dict[str, str]) -> None:
        self.spec, self.log_path, self.port = spec, log_path, free_port()
        self.env = {**env, "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
                    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        s = self.spec
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model_dir),
               "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", str(s.max_model_len),
               "--enforce-eager", "--num-gpu-blocks-override", str(s.pages), "--block-size", str(PAGE_TOKENS),
               "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        if s.transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(s.transfer)]
        return cmd

    def start(self, timeout_s: float = 600.0) -> "VllmServer":
        """Start it and poll ``/health`` until it answers; RuntimeError with the log's tail if the
        server exits or is not ready in ``timeout_s``."""
        began = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not self._healthy():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited ({self.proc.returncode}) while starting; {self.log_path}:\n"
                                       f"{self.log_tail()}")
                if time.perf_counter() - began > timeout_s:
                    raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s; {self.log_path}:\n{self.log_tail()}")
                time.sleep(0.5)
        except BaseException:  # Ctrl-C included: no server outlives the bench
            self.stop()
            raise
        self.startup_s = time.perf_counter() - began
        return self

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # workers that outlived the API server
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def __enter__(self) -> "VllmServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- metrics and trace ------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text from ``url`` as (name, labels, value) samples; [] if it cannot be read."""
    import httpx

    try:
        text = httpx.get(url, timeout=10.0).text
    except httpx.HTTPError:
        return []
    samples = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found and not line.startswith("#"):
            labels = dict(_LABEL.findall(found.group(2) or ""))
            samples.append((found.group(1), labels, float(found.group(3))))
    return samples


def read_trace(path: Path) -> list[dict]:
    """The connector's trace lines (one JSON object per request lookup); [] if none were written."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by the server's stop
    return rows


# -- streaming client -------------------------------------------------------------------------


def request_body(prompt: list[int], answer_tokens: int) -> dict:
    """Greedy, exactly ``answer_tokens`` new tokens, streamed with their token ids and usage."""
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": answer_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


async def stream_completion(http, url: str, prompt: list[int], answer_tokens: int, clock: Callable[[], float]) -> dict:
    """One streamed completion: send time, time to first token, the gaps between tokens (a chunk
    of k tokens counts k gaps of 1/k its wait), end time, the token ids and vLLM's usage."""
    record = {"sent_s": clock(), "ttft_s": None, "itl_s": [], "end_s": None, "output_tokens": 0,
              "token_ids": [], "prompt_tokens": len(prompt), "cached_tokens": None, "error": None}
    last = None
    try:
        async with http.stream("POST", url + "/v1/completions", json=request_body(prompt, answer_tokens)) as reply:
            if reply.status_code != 200:
                record["error"] = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:300]}"
                return record
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = clock()
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if not ids:
                        continue
                    if last is None:
                        record["ttft_s"] = now - record["sent_s"]
                    else:
                        record["itl_s"] += [(now - last) / len(ids)] * len(ids)
                    last = now
                    record["token_ids"] += ids
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record["prompt_tokens"] = usage.get("prompt_tokens", len(prompt))
                    record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except Exception as exc:  # a failed request is a record with its error, never a failed run
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        record["end_s"] = clock()
        record["output_tokens"] = len(record["token_ids"])
    return record


async def play(url: str, workload: Workload, arrivals: list[float], timeout_s: float,
               progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Send every turn at its arrival time, or once the turn it follows has finished if later;
    one record per turn (``arrival_s``, ``sent_s``, ``end_s`` from the start of the run)."""
    import httpx

    began = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - began

    finished = {t.index: asyncio.Event() for t in workload.turns}
    answers: dict[int, list[int]] = {}
    records: list[dict] = []
    limits = httpx.Limits(max_connections=len(workload.turns) + 4, max_keepalive_connections=len(workload.turns))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
        async def one(turn: Turn, arrival: float) -> None:
            await asyncio.sleep(max(0.0, arrival - clock()))
            if turn.follows is not None:
                await finished[turn.follows].wait()
            record = await stream_completion(http, url, workload.prompt(turn, answers),
                                             workload.config.answer_tokens, clock)
            answers[turn.index] = record.pop("token_ids")
            record.update(turn=turn.index, user=turn.user, round=turn.round, arrival_s=arrival)
            records.append(record)
            finished[turn.index].set()
            if progress:
                progress(len(records), len(workload.turns))

        await asyncio.gather(*(one(t, a) for t, a in zip(workload.turns, arrivals)))
    return sorted(records, key=lambda r: r["turn"])


def probe(url: str, prompt: list[int], answer_tokens: int, timeout_s: float = 600.0) -> dict:
    """One request on the idle server before the workload: its first request pays lazy set-up,
    and its TTFT is an uncontended cold prefill of a context-sized prompt."""
    import httpx

    async def run() -> dict:
        began = time.perf_counter()
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as http:
            return await stream_completion(http, url, prompt, answer_tokens, lambda: time.perf_counter() - began)

    return asyncio.run(run())
