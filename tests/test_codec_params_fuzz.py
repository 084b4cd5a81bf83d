"""Every registered codec's decoder against forged codec params (issue #39).

Codec params travel in the block header and are a client's word (a Put's ``codec_params_json``)
or whatever a shared tier holds. For every codec in the registry (quantizers alone, with each
lossless stage and with two; each calibrated codec's spellings on a post-RoPE and a RoPE-aware
calibration) a real block is encoded, then each node of its params (every key, list element and
the params themselves) is forged: negative, huge, zero, off by one, float, NaN, infinity,
string, list, dict, None, bool, missing; absent keys are added; the payload is cut or extended.
Each forged block must decode to the block's shape and dtype or raise ValueError (codec errors
derive from it), within `SLOW_S`, and allocate at most `memory_bound` while it does
(tracemalloc: Python and numpy buffers; `test_forged_sink_tokens_do_not_grow_the_process`
adds the process's peak RSS, torch included, for the reported case).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from compression import QUANTIZERS, STAGES, calibration_store, get_codec
from compression.base import CALIBRATED
from compression.calibration import Allocation, Calibration
from compression.calibration_fit import calibrate
from tests.test_transform_codec import INV_FREQ, kv_block, rope_block

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HEADS, HEAD_DIM = 3, 2, 64  # the layout of the uncalibrated codecs' blocks
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# every calibrated codec's spellings (a new one fails `test_every_calibrated_codec_is_fuzzed` until listed)
CALIBRATED_FORMS = {"kvtc": ("kvtc", "kvtc-rans", "kvtc-zstd")}
ABSENT_KEYS = ("sink_tokens", "start", "size", "bits", "group_size", "meta_dtype", "sections", "stages", "quant",
               "calibration", "entropy", "level")
ADDED_KEYS, ADDED_VALUES = 4, (-5, 2**40, "abc", None, -(10**9))  # absent keys added to each JSON object
SLOW_S = 5.0  # a decode, forged or not, takes at most this on these small blocks (about 10 ms here)


def memory_bound(block: torch.Tensor) -> int:
    """The most a decode of ``block``'s encoding may allocate, forged or not: 4x its decoded size + 16 MiB."""
    return 4 * block.numel() * block.element_size() + (16 << 20)


def forgeries(value) -> list:
    """Values to put where ``value`` was: wrong in kind, sign, size or type."""
    out = [-5, -(10**6), -(10**9), 0, 2**40, 2**63, 1.5, math.nan, math.inf, "7", "abc", [1], {}, None, True]
    if type(value) is int:
        out += [value - 1, value + 1, -value, value * (1 << 20), float(value), str(value)]
    elif isinstance(value, str) and value:
        out += [value[:-1], value + "0", value.upper()]
    elif isinstance(value, list) and value:
        out += [value[:-1], value + value[-1:], value[::-1]]
    return out


def nodes(tree, path=()):
    """Every node's path in a params tree (the root, each dict value and list element, recursively)."""
    yield path
    if isinstance(tree, dict):
        for key in sorted(tree):
            yield from nodes(tree[key], path + (key,))
    elif isinstance(tree, list):
        for i, item in enumerate(tree):
            yield from nodes(item, path + (i,))


def replaced(params, path, value=None, remove=False):
    """A deep copy of params with the node at ``path`` set to ``value`` (or removed), JSON round-tripped."""
    if not path:
        forged = {} if remove else value
    else:
        forged = copy.deepcopy(params)
        parent = forged
        for step in path[:-1]:
            parent = parent[step]
        if remove:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    return json.loads(json.dumps(forged))  # what a header gives back (NaN, Infinity and 2**63 included)


def cases(params, payload: bytes, seed: int):
    """(what, params, payload) for every forgery of one encoded block."""
    rng = random.Random(seed)
    for path in nodes(params):
        node = params
        for step in path:
            node = node[step]
        for value in forgeries(node):
            yield f"{path}={value!r:.40}", replaced(params, path, value), payload
        if path:
            yield f"{path} missing", replaced(params, path, remove=True), payload
        if isinstance(node, dict):  # a few absent keys, one value each (keys a codec reads get every forgery)
            absent = [key for key in ABSENT_KEYS if key not in node]
            for key in rng.sample(absent, min(ADDED_KEYS, len(absent))):
                value = rng.choice(ADDED_VALUES)
                yield f"{path + (key,)}={value!r} added", replaced(params, path + (key,), value), payload
    extra = bytes(rng.randrange(256) for _ in range(4))
    for what, forged in (("payload empty", b""), ("payload - 1 byte", payload[:-1]),
                         ("payload - 3 bytes", payload[:-3]), ("payload + 1 byte", payload + extra[:1]),
                         ("payload + 4 bytes", payload + extra)):
        yield what, params, forged


def decode_outcome(codec, payload: bytes, params, block: torch.Tensor) -> str | None:
    """None when the forged block decoded to ``block``'s shape and dtype or was refused with a ValueError
    in time and within `memory_bound`; else what went wrong."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    problem = None
    try:
        out = codec.decode(payload, params, tuple(block.shape), block.dtype)
        if tuple(out.shape) != tuple(block.shape) or out.dtype != block.dtype:
            problem = f"decoded to {out.dtype} {tuple(out.shape)}"
    except ValueError:
        pass
    except Exception as exc:  # noqa: BLE001 (what the test looks for)
        problem = f"{type(exc).__name__}: {str(exc)[:120]}"
    elapsed = time.perf_counter() - started
    grown = tracemalloc.get_traced_memory()[1] - before
    if grown > memory_bound(block):
        problem = f"{problem or 'refused'}, but allocated {grown >> 20} MiB (bound {memory_bound(block) >> 20} MiB)"
    if elapsed > SLOW_S:
        problem = f"{problem or 'refused'}, but took {elapsed:.1f} s"
    return problem


def fuzz(spec: str, block: torch.Tensor, seed: int) -> None:
    codec = get_codec(spec)
    encoded = codec.encode(block)
    params = json.loads(json.dumps(encoded.params))
    assert decode_outcome(codec, encoded.payload, params, block) is None  # the block as written decodes
    failures = []
    tracemalloc.start()
    try:
        for what, forged, payload in cases(params, encoded.payload, seed):
            problem = decode_outcome(codec, payload, forged, block)
            if problem:
                failures.append(f"{what}: {problem}")
    finally:
        tracemalloc.stop()
    assert not failures, f"{spec}: {len(failures)} forged blocks not refused cleanly:\n" + "\n".join(failures[:40])


def uncalibrated_specs() -> list[str]:
    """Each quantizer alone, with each lossless stage, and with a shuffle and each compressing stage after it."""
    specs = []
    for quantizer in sorted(QUANTIZERS):
        specs.append(quantizer)
        specs += [f"{quantizer}+{stage}" for stage in sorted(STAGES)]
        specs += [f"{quantizer}+shuffle+{stage}" for stage in sorted(STAGES) if stage != "shuffle"]
    return specs


@pytest.mark.parametrize("spec", uncalibrated_specs())
def test_forged_params_are_refused(spec):
    seed = uncalibrated_specs().index(spec)
    rng = random.Random(seed)
    tokens = rng.randrange(37, 257)
    g = torch.Generator().manual_seed(seed)
    block = torch.randn(LAYERS, 2, HEADS, tokens, HEAD_DIM, generator=g) * torch.exp(
        torch.randn(LAYERS, 2, HEADS, 1, HEAD_DIM, generator=g)) + 0.1  # irregular scales, never zero
    fuzz(spec, block.to(DTYPES[seed % len(DTYPES)]), seed)


@pytest.fixture(scope="module")
def calibrations() -> dict[str, Calibration]:
    """The calibrations of tests/test_transform_codec.py: post-RoPE, and RoPE-aware with 4 sink tokens."""
    post = calibrate([kv_block(300, seed=1), kv_block(200, seed=2)], Allocation(0.2, 0.3), source="test")
    rope = calibrate([rope_block(300, 0, seed=1, dtype=torch.float32), rope_block(200, 0, seed=2, dtype=torch.float32)],
                     Allocation(0.2, 0.3, sink_tokens=4), rope_inv_freq=INV_FREQ, max_position=8192,
                     source="test, pre-RoPE")
    return {"post-rope": post, "rope": rope}


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration_store.CALIBRATION_DIR_ENV, str(tmp_path / "calibrations"))


def test_every_calibrated_codec_is_fuzzed():
    assert set(CALIBRATED) <= set(CALIBRATED_FORMS), "list the new calibrated codec's spellings in CALIBRATED_FORMS"


CALIBRATED_CASES = [(form, kind, stages) for name in sorted(CALIBRATED_FORMS) for form in CALIBRATED_FORMS[name]
                    for kind in ("post-rope", "rope") for stages in ("", "+zstd")
                    if not stages or (form == name and kind == "rope")]


@pytest.mark.parametrize("form, kind, stages", CALIBRATED_CASES)
def test_forged_calibrated_params_are_refused(calibrations, form, kind, stages):
    seed = CALIBRATED_CASES.index((form, kind, stages))
    calibration = calibrations[kind]
    calibration_store.register(calibration)
    tokens = random.Random(seed).randrange(37, 257)
    dtype = DTYPES[seed % len(DTYPES)]
    block = rope_block(tokens, 0, seed=10 + seed, dtype=dtype) if kind == "rope" else kv_block(tokens, 10 + seed, dtype)
    fuzz(f"{form}@{calibration.id}{stages}", block, seed)


REPRO = """
import json, resource, sys, tracemalloc
import torch
from compression import calibration_store, get_codec
from compression.calibration import Allocation
from compression.calibration_fit import calibrate
from tests.test_transform_codec import INV_FREQ, rope_block

cal = calibrate([rope_block(300, 0, seed=1, dtype=torch.float32), rope_block(200, 0, seed=2, dtype=torch.float32)],
                Allocation(0.2, 0.3, sink_tokens=4), rope_inv_freq=INV_FREQ, max_position=8192)
calibration_store.register(cal)
block = rope_block(64, 0, seed=5)  # a 3.8 kB kvtc block, as reported
codec = get_codec("kvtc@" + cal.id)
encoded = codec.encode(block)
report = {"payload_bytes": len(encoded.payload), "decoded_bytes": block.numel() * block.element_size(), "cases": []}
tracemalloc.start()
for sink_tokens in json.loads(sys.argv[1]):
    params = dict(encoded.params, sink_tokens=sink_tokens)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.reset_peak()
    traced_before = tracemalloc.get_traced_memory()[0]
    try:
        codec.decode(encoded.payload, params, tuple(block.shape), block.dtype)
        outcome = "decoded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {str(exc)[:160]}"
    report["cases"].append({"sink_tokens": sink_tokens, "outcome": outcome,
                            "traced": tracemalloc.get_traced_memory()[1] - traced_before,
                            "rss_growth": 1024 * (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before)})
print(json.dumps(report))
"""


def test_forged_sink_tokens_do_not_grow_the_process():
    """The reported case: a kvtc block of a few kB whose sink_tokens is forged, decoded in a fresh
    process; each is refused with a ValueError, and neither traced memory nor the peak RSS grows past the bound."""
    forged = [-(10**9), -(10**7), -5, 10**7, 10**9]  # -(10**7) grew the process by 42 MB before
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{calibration_store.CALIBRATION_DIR_ENV: "/nonexistent"})
    run = subprocess.run([sys.executable, "-c", REPRO, json.dumps(forged)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["payload_bytes"] < 4096
    bound = 4 * report["decoded_bytes"] + (16 << 20)
    for case in report["cases"]:
        assert case["outcome"].startswith("ValueError: kvtc: sink_tokens"), case
        assert case["traced"] <= bound and case["rss_growth"] <= bound, case
