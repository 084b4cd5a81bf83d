"""The files a warm hit in the reference engine crosses, client and daemon, counted from a trace.

A small random-weight model (rows large enough for the one-copy load) and a daemon with a CPU tier,
run in this process so one profiler sees both sides: a cold request stores its chunks, then a warm
one's load is traced: `CachedEngine._load_prefix`, given the prompt's keys, until the reused run is
in the KV cache (steps 2 and 3 of docs/architecture.md's request path, lookup and load; computing
the keys, step 1, is not counted). What is counted:

- **files**: the project's Python files any traced call entered, in first-visit order;
- **returns**: the distinct steps (caller's file, callee's file) that enter a file visited before
  from another one, the caller being the nearest project frame up the same thread's stack: each is
  a reader's "back to a file already open" (a loop over blocks repeats a step; it is counted once).
  Calls within one file, and Python's returns from a call, are not counted.

Threads are all traced (the daemon's event loop, its copy threads, the client's): the path is one
request's, whichever thread runs it; the daemon's periodic tick (`BACKGROUND`), which may fall
inside the traced load, is not counted. Native code (kernels/*.c) is named where its Python wrapper is.

    python scripts/warm_hit_path.py            # the path, files and returns
    python scripts/warm_hit_path.py --json     # the same as JSON (tests/test_floors.py reads it)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages, not an installed copy's
    sys.path.insert(0, str(ROOT))
PROJECT = ("kvstore", "tiers", "compression", "blend", "engine_adapter", "kernels")
#: Background work that may fall inside the traced load and is not the request's: not counted.
BACKGROUND = ("BlockStore._tick",)


@dataclass
class CallPath:
    """What a trace of one warm hit saw."""
    files: list[str] = field(default_factory=list)        # first-visit order
    returns: list[tuple[str, str]] = field(default_factory=list)  # (from file, back into file)
    calls: list[tuple[str, str]] = field(default_factory=list)    # (file, function) at first entry of each file


def _project_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] not in PROJECT or "proto" in rel.parts:  # generated stubs are not read
        return None
    return str(rel)


class Recorder:
    def __init__(self) -> None:
        self.on = False
        self.path = CallPath()
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._cache: dict[str, str | None] = {}

    def _file(self, code) -> str | None:
        name = code.co_filename
        if name not in self._cache:
            self._cache[name] = _project_file(name)
        return self._cache[name]

    def profile(self, frame, event, arg):
        if not self.on or event != "call":
            return
        callee = self._file(frame.f_code)
        if callee is None:
            return
        background = frame
        while background is not None:  # the key index's 100 ms tick is no request's work
            if background.f_code.co_qualname in BACKGROUND:
                return
            background = background.f_back
        caller, up = None, frame.f_back
        while up is not None and caller is None:
            caller = self._file(up.f_code)
            up = up.f_back
        if caller == callee:
            return
        with self._lock:
            if callee in self._seen:
                if caller is not None and (caller, callee) not in self.path.returns:
                    self.path.returns.append((caller, callee))
                return
            self._seen.add(callee)
            self.path.files.append(callee)
            self.path.calls.append((callee, frame.f_code.co_qualname))


def trace_warm_hit(chunk_tokens: int = 32, chunks: int = 4) -> CallPath:
    """Run a cold then a traced warm request; the warm one's path."""
    import torch

    from engine_adapter.cached import CachedEngine
    from engine_adapter.client.kvstore_client import KVStoreClient
    from engine_adapter.reference.model import LlamaModel, ModelConfig
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.process import Daemon

    recorder = Recorder()
    folder = Path(tempfile.mkdtemp(prefix="kvstore-path-"))
    config = DaemonConfig(listen=f"unix:{folder / 'kvstore.sock'}", cpu_capacity=64 << 20, disk_path="",
                          metrics_listen="", shm_index=True)
    started, stop_loop = threading.Event(), {}

    def serve() -> None:
        async def main() -> None:
            daemon = Daemon(config)
            await daemon.start()
            stop = asyncio.Event()
            stop_loop["stop"] = (asyncio.get_running_loop(), stop)
            started.set()
            await stop.wait()
            await daemon.stop(grace=0)
        asyncio.run(main())

    threading.setprofile(recorder.profile)  # every thread started from here on: the daemon's too
    sys.setprofile(recorder.profile)
    server = threading.Thread(target=serve, name="daemon", daemon=True)
    server.start()
    try:
        if not started.wait(30):
            raise RuntimeError("the in-process daemon did not start")
        config_m = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, attention_bias=False, max_position_embeddings=1024,
                               bos_token_id=1, eos_token_ids=(2,), model_id="path-probe")
        torch.manual_seed(0)
        model = LlamaModel(config_m)
        prompt = torch.randint(3, 97, (chunk_tokens * chunks + 5,)).tolist()
        with KVStoreClient(config.listen) as client:
            engine = CachedEngine(model, SimpleNamespace(eos_token_ids=(2,)), client, chunk_tokens=chunk_tokens)
            engine.generate(prompt, max_new_tokens=1).store_done.wait(30)
            kv = engine._take_cache(len(prompt) + 1)  # the warm request's cache, as generate takes it
            from kvstore.keys import prefix_keys

            keys = prefix_keys(engine.namespace, prompt[:-1])
            tiers: list[str] = []
            recorder.on = True
            reused = engine._load_prefix(keys, kv, tiers)
            recorder.on = False
            if reused != chunks * chunk_tokens:
                raise RuntimeError(f"the warm request reused {reused} tokens, not {chunks * chunk_tokens}")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        if "stop" in stop_loop:
            loop, stop = stop_loop["stop"]
            loop.call_soon_threadsafe(stop.set)
            server.join(30)
        shutil.rmtree(folder, ignore_errors=True)
    return recorder.path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the path as JSON")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    path = trace_warm_hit()
    if args.json:
        print(json.dumps({"files": path.files, "returns": path.returns, "calls": path.calls}))
        return 0
    print(f"a warm hit crosses {len(path.files)} files with {len(path.returns)} returns "
          f"({time.perf_counter() - started:.1f} s)")
    for file, function in path.calls:
        print(f"  {file:<40} {function}")
    print("returns (from -> back into):")
    for caller, callee in path.returns:
        print(f"  {caller} -> {callee}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
