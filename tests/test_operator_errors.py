"""What an operator meets next (issue #40): an operator's way to clear a daemon with tenants, bad
codec and memory settings refused at start in one line, `kvstore ingest` past the model's context
and under Ctrl-C, benchmarks without their data, no PyTorch warning in the daemon's log, and help
that speaks the user's words. Real daemons and real ``kvstore`` subprocesses throughout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from tests.conftest import ROOT, exec_after
from tests.test_daemon import LAYOUT, NS, make_blocks
from tests.test_operator import SMALL, finish, kvstore, one_line_error, serve

TENANT_A, TENANT_B = "token-of-tenant-a-0123456789", "token-of-tenant-b-0123456789"
ADMIN = "the-operators-admin-token-0123"


def _secret_file(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _tenants_file(folder: Path, token_b: str = TENANT_B) -> Path:
    return _secret_file(folder, "tenants.toml", f'[[tenant]]\nname = "a"\ntoken = "{TENANT_A}"\n\n'
                                                f'[[tenant]]\nname = "b"\ntoken = "{token_b}"\n')


def _put(client: KVStoreClient, n: int, seed: int) -> list[bytes]:
    keys, payloads = make_blocks(n, seed=seed)
    client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    return keys


def _wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _bundled_model() -> Path:
    pytest.importorskip("gguf")
    try:
        from engine_adapter.reference.loader import find_smollm2_gguf

        return Path(find_smollm2_gguf())
    except Exception as exc:  # noqa: BLE001 - no bundled model here
        pytest.skip(f"no bundled model: {exc}")


# -- 1. the operator's admin token ---------------------------------------------------------------


def test_the_admin_token_clears_and_reads_stats_where_tenants_cannot(daemon_factory, short_tmp):
    """With a tenants file, a tenant may not clear (its Clear would drop everyone's blocks), and
    before admin_token nobody could. The admin token (read from a file) clears through `kvstore
    clear` and reads the daemon-wide `kvstore stats`; it is no tenant: Put, Get and Lookup with it
    are PERMISSION_DENIED, saying why."""
    admin_file = _secret_file(short_tmp, "admin-token", ADMIN)
    tenant_file = _secret_file(short_tmp, "tenant-a-token", TENANT_A)
    d = daemon_factory(tenants_file=_tenants_file(short_tmp), admin_token_file=admin_file, cpu_capacity="16MiB")
    with KVStoreClient(d.address, token=TENANT_A) as a, KVStoreClient(d.address, token=TENANT_B) as b:
        keys_a = _put(a, 3, seed=1)
        _put(b, 2, seed=2)

        refused = finish(kvstore("clear", "--address", d.address, "--token-file", tenant_file))
        one_line_error(refused, "PERMISSION_DENIED", "a tenant deletes its own with Delete", "admin token")

        code, out, err = finish(kvstore("stats", "--address", d.address, "--json", "--token-file", admin_file))
        assert code == 0, err
        assert json.loads(out)["tiers"]["cpu"]["blocks"] == 5  # the daemon's, not one tenant's

        with KVStoreClient(d.address, token=ADMIN, shared_memory=False) as admin:
            for call in (lambda: admin.lookup(keys_a), lambda: admin.get(keys_a, 2**20, inline=True),
                         lambda: _put(admin, 1, seed=3)):
                with pytest.raises(grpc.RpcError) as denied:
                    call()
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "admin token" in denied.value.details() and "no blocks" in denied.value.details()

        # the operator's token from the environment, as a service's would be
        code, out, err = finish(kvstore("clear", "--address", d.address, env={"KVSTORE_AUTH_TOKEN": ADMIN}))
        assert code == 0 and int(re.fullmatch(r"cleared (\d+) blocks", out.strip())[1]) >= 5, (out, err)
        assert a.lookup(keys_a).hits == 0
        with KVStoreClient(d.address, token=ADMIN, shared_memory=False) as admin:
            assert sum(t["blocks"] for t in admin.stats()["tiers"].values()) == 0  # every tier, every tenant
        assert b.stats()["tiers"]["cpu"]["capacity_bytes"] == 16 * 2**20  # the tenants are still served


def test_beside_an_admin_token_the_shared_auth_token_cannot_clear(daemon_factory):
    """With auth_token and an admin token, the shared token is every client's: it Puts and Deletes
    but Clear is the operator's alone (on ee82bf6 any holder of the shared token could Clear)."""
    shared = "shared-client-token-0123456789"
    d = daemon_factory(auth_token=shared, admin_token=ADMIN, cpu_capacity="16MiB")
    with KVStoreClient(d.address, token=shared) as client:
        keys = _put(client, 2, seed=4)
        with pytest.raises(grpc.RpcError) as denied:
            client.clear()
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin token" in denied.value.details()
        assert client.lookup(keys).hits == 2
        with KVStoreClient(d.address, token=ADMIN, shared_memory=False) as admin:
            assert admin.clear() >= 2
        assert client.lookup(keys).hits == 0


def test_admin_token_settings_that_cannot_work_are_refused_at_start(short_tmp):
    """A short admin token, one without any tokens to stand apart from, one a tenant also holds,
    one given twice, and an unreadable admin_token_file: each one line at start, exit 1."""
    sock = f"unix:{short_tmp / 'kv.sock'}"
    tenants = _tenants_file(short_tmp)
    cases = [
        (dict(auth_token="an-auth-token-0123456789", admin_token="short"), ["admin_token", "at least 16"]),
        (dict(admin_token=ADMIN), ["admin_token needs auth_token or tenants_file"]),
        (dict(tenants_file=tenants, admin_token=TENANT_B), ["tenant 'b' has the admin token"]),
        (dict(auth_token="an-auth-token-0123456789", admin_token=ADMIN,
              admin_token_file=short_tmp / "admin"), ["admin_token and admin_token_file"]),
        (dict(auth_token="an-auth-token-0123456789", admin_token_file=short_tmp / "missing"),
         [f"admin_token_file {short_tmp / 'missing'}", "No such file"]),
    ]
    procs = [kvstore(*serve(listen=sock, disk_path="", **settings)) for settings, _ in cases]
    for proc, (_, words) in zip(procs, cases):
        one_line_error(finish(proc), *words)


# -- 2. codecs: an unknown calibration is refused at start ----------------------------------------


def test_a_codec_naming_an_unknown_calibration_is_refused_at_start(short_tmp):
    """`--disk-codec kvtc@<id>` (or `--s3-codec`) with no such calibration used to start and then
    fail every write to that tier, logged per write. Now: one line naming the setting, the id, the
    folder searched and how to make one. An unknown codec name names its setting too."""
    sock = f"unix:{short_tmp / 'kv.sock'}"
    folder = short_tmp / "calibrations"
    unknown = "0123456789abcdef"
    disk = kvstore(*serve(listen=sock, disk_path=short_tmp / "disk", disk_codec=f"kvtc@{unknown}",
                          calibration_dir=folder))
    # refused before the S3 tier is even tried (nothing listens on port 1)
    s3 = kvstore(*serve(listen=sock, disk_path="", s3_bucket="bucket", s3_endpoint="http://127.0.0.1:1",
                        s3_codec=f"kvtc-zstd@{unknown}+zstd"), env={"KVSTORE_CALIBRATION_DIR": str(folder)})
    named = kvstore(*serve(listen=sock, disk_path=short_tmp / "disk", disk_codec="int9"))
    for proc, setting in ((disk, "disk_codec"), (s3, "s3_codec")):
        one_line_error(finish(proc), f"kvstore: {setting} kvtc", f"no calibration {unknown} in {folder}",
                       "kvstore calibrate")
    one_line_error(finish(named), "kvstore: disk_codec: unknown codec 'int9'", "(from --disk-codec)")


def test_a_known_calibration_starts_and_codes_disk_blocks_without_a_torch_warning(daemon_factory, short_tmp):
    """The other side of the check: a calibration in calibration_dir starts, and blocks written
    behind to disk are coded with it. The daemon's log holds no PyTorch "buffer is not writable"
    warning (once per process, from decoding each read-only raw payload it re-encoded)."""
    import torch

    from compression import calibration_store
    from compression.calibration import Allocation
    from compression.calibration_fit import calibrate

    keys, payloads = make_blocks(8, seed=5)  # 512 tokens: enough for 192-channel rows
    shape = LAYOUT.block_shape(64)
    blocks = [torch.from_numpy(p.copy()).view(shape) for p in payloads]
    calibration = calibrate(blocks, Allocation(0.3, 0.6), source="test_operator_errors")
    keys, payloads = keys[:4], payloads[:4]
    calibration_store.save(calibration, short_tmp / "calibrations")
    d = daemon_factory(disk_codec=f"kvtc@{calibration.id[:16]}", calibration_dir=short_tmp / "calibrations",
                       write_policy="write-through", **{**SMALL, "disk_capacity": "64MiB"})
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        _wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] == 4, what="the disk copies")
        client.clear(["cpu"])
        with client.fetch(keys, LAYOUT.block_bytes(64)) as fetched:
            assert [b.codec.startswith("kvtc") for b in fetched] == [True] * 4
    assert d.stop() == 0
    log = d.log.read_text()
    assert "not writable" not in log and "Traceback" not in log, log[-3000:]


def test_decoding_blocks_from_read_only_bytes_warns_nothing(short_tmp):
    """Every payload decode on the daemon's paths (compression/transcode.py: raw views, re-encoding into
    int8 and kvtc, decoding those) from immutable ``bytes``, with warnings as errors, in a fresh
    process (PyTorch warns once per process, so an earlier test could hide it)."""
    script = f"""
import warnings
warnings.simplefilter("error")
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from compression import calibration_store
from compression.base import tensor_bytes
from compression.calibration import Allocation
from compression.calibration_fit import calibrate
from kvstore.block import BlockHeader, payload_checksum
from compression.transcode import decode_payload, transcode
from tests.test_daemon import LAYOUT, make_blocks

_, payloads = make_blocks(8, seed=9)
shape = LAYOUT.block_shape(64)
blocks = [torch.from_numpy(p.copy()).view(shape) for p in payloads]
calibration = calibrate(blocks, Allocation(0.3, 0.6), source="warnings")
calibration_store.register(calibration)
raw = tensor_bytes(blocks[0])
header = BlockHeader(key=bytes(16), namespace=bytes(16), layout=LAYOUT, tokens=64, payload_len=len(raw),
                     checksum=payload_checksum(raw), codec="raw", codec_params={{}})
assert torch.equal(decode_payload(header, raw), blocks[0])
for spec in ("int8", "int4", "int8+shuffle+zstd", "kvtc@" + calibration.id):
    coded, payload = transcode(header, raw, spec)
    decode_payload(coded, bytes(payload))
print("clean")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=short_tmp)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-3000:]


# -- 3. a CPU tier the machine cannot hold --------------------------------------------------------


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    pytest.skip(f"no {field} in /proc/meminfo")


def test_a_cpu_capacity_beyond_the_available_memory_is_refused_in_one_line(short_tmp):
    """Before: `kvstore: Cannot allocate memory`, naming nothing (or, where the kernel overcommits,
    a daemon that takes the machine's memory as it prefaults). Now the setting and both sizes."""
    capacity_gib = 4 * _meminfo("MemTotal") // 2**30
    result = finish(kvstore(*serve(listen=f"unix:{short_tmp / 'kv.sock'}", disk_path="",
                                   cpu_capacity=f"{capacity_gib}GiB")))
    one_line_error(result, f"kvstore: cpu_capacity {capacity_gib:.1f} GiB is more than this machine's available "
                           "memory (", "lower --cpu-capacity")


def test_an_arena_that_cannot_be_allocated_names_cpu_capacity(short_tmp):
    """Memory the machine has but the process may not map (an address-space limit, as a container
    or `ulimit -v` sets): the allocation's ENOMEM becomes one line naming the tier and the setting."""
    if _meminfo("MemAvailable") < 4 * 2**30:
        pytest.skip("needs 4 GiB available, so that only the address-space limit refuses 3 GiB")

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "kvstore.cli",
               *serve(listen=f"unix:{short_tmp / 'kv.sock'}", disk_path="", cpu_capacity="3GiB")]
    proc = subprocess.Popen(exec_after("resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))", command),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one_line_error(finish(proc), "kvstore: cannot allocate the cpu tier's 3.0 GiB arena (Cannot allocate memory",
                   "lower cpu_capacity (--cpu-capacity)")


# -- 4, 5. kvstore ingest past the model's context, and under Ctrl-C ------------------------------


def _model_with_context(folder: Path, context: int) -> Path:
    """A copy of the bundled GGUF whose metadata says ``context`` tokens (the weights unchanged), so
    a text past the context costs seconds to ingest, not the minutes 8,192 tokens take on 2 cores."""
    import gguf

    copy = folder / "smollm2-short-context.gguf"
    shutil.copy(_bundled_model(), copy)
    reader = gguf.GGUFReader(copy, "r+")
    field = reader.fields["llama.context_length"]
    field.parts[field.data[0]][0] = context
    del reader  # flushes the memory map
    return copy


def _sample_document() -> str:
    from engine_adapter.demo import load_sample

    return load_sample()["document"]


@pytest.mark.slow
def test_ingest_past_the_models_context_warns_and_stores_only_usable_chunks(daemon_factory, short_tmp):
    """A document longer than the model's context used to be stored whole: chunks no prompt can
    ever reach. Now a warning names how many tokens were beyond the context, and only the chunks
    a prompt can use (ending before the context's last position) are stored."""
    model = _model_with_context(short_tmp, 512)
    d = daemon_factory(**SMALL)
    text = short_tmp / "long.txt"
    text.write_text(" ".join(_sample_document().split()[:700]))  # ~1,000 tokens with the prompt
    code, out, err = finish(kvstore("ingest", text, "--address", d.address, "--model", model), timeout=300)
    assert code == 0, err
    warning = [line for line in err.splitlines() if "beyond the model's context" in line]
    assert len(warning) == 1, err
    tokens, beyond = map(int, re.search(r": (\d+) tokens with the prompt, (\d+) beyond the model's context of 512 "
                                        r"tokens: only its first 1 chunks \(256 tokens\) are stored", warning[0]).groups())
    assert tokens > 768 and beyond == tokens - 512
    assert f"{text}: {tokens} tokens, 1 chunks stored, 0 already cached ({beyond} tokens beyond the context" in out
    with KVStoreClient(d.address) as client:
        assert client.stats()["tiers"]["cpu"]["blocks"] == 1


def test_the_context_overflow_is_the_tokens_past_the_context():
    from engine_adapter.commands import context_overflow

    assert context_overflow(9000, 8192) == 808
    assert context_overflow(8192, 8192) == 0
    assert context_overflow(100, 0) == 0  # no context known: nothing is cut


def _wait_for_output(stream, pattern: bytes, timeout: float, seen: bytearray) -> None:
    """Read ``stream`` (a pipe) into ``seen`` until ``pattern`` appears."""
    os.set_blocking(stream.fileno(), False)
    deadline = time.monotonic() + timeout
    while not re.search(pattern, bytes(seen)):
        assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s: {bytes(seen)[-2000:]!r}"
        chunk = stream.read()
        if chunk:
            seen += chunk
        else:
            time.sleep(0.05)


def _interrupt(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group (children included)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    os.set_blocking(proc.stdout.fileno(), True)
    os.set_blocking(proc.stderr.fileno(), True)
    return proc.returncode, proc.stdout.read().decode(), proc.stderr.read().decode()


def _cli(*args: object, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``kvstore ARGS`` in a session of its own (its process group is what Ctrl-C reaches), bytes out."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    child_env["PYTHONPATH"] = str(ROOT)
    child_env.update(env or {})
    # SIGINT as a terminal leaves it: a runner started in the background (`cmd &`) ignores SIGINT,
    # and a child would inherit that and never see the Ctrl-C these tests send.
    return subprocess.Popen(exec_after("signal.signal(signal.SIGINT, signal.SIG_DFL)",
                                       [sys.executable, "-m", "kvstore.cli", *args]),
                            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.slow
def test_ctrl_c_during_ingest_exits_130_saying_what_was_stored(daemon_factory, short_tmp):
    """Ctrl-C while ingest prefills: no traceback (it was 13 frames), exit 130, and one line saying
    how many chunks this run stored, which stay in the daemon."""
    _bundled_model()
    d = daemon_factory(**SMALL)
    text = short_tmp / "document.txt"
    text.write_text(_sample_document())
    proc = _cli("ingest", text, "--address", d.address)
    seen = bytearray()
    try:
        _wait_for_output(proc.stderr, rb"document\.txt:.*\| *[1-9]\d*/\d+ \[", 240, seen)  # a chunk stored
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    code, out, err = _interrupt(proc)
    err = seen.decode(errors="replace") + err
    assert code == 130, (code, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    said = re.search(r"kvstore: interrupted: (\d+) chunks stored by this run stay in the daemon \(cached now: "
                     r"document\.txt (\d+) of (\d+)\)", err)
    assert said, err
    stored = int(said[1])
    assert stored >= 1 and int(said[2]) == stored < int(said[3])
    with KVStoreClient(d.address) as client:  # an interrupted Put may have landed after the count
        assert stored <= client.stats()["tiers"]["cpu"]["blocks"] <= stored + 1


@pytest.mark.slow
def test_ctrl_c_during_the_demo_exits_130_and_stops_its_daemon(short_tmp):
    """Ctrl-C while the demo runs its first question: no traceback, exit 130, its daemon stopped
    (its temp folder gone) and a line saying what stays on disk."""
    _bundled_model()
    cache, scratch = short_tmp / "cache", short_tmp / "tmp"
    scratch.mkdir()
    proc = _cli("demo", "--max-new-tokens", "4", env={"XDG_CACHE_HOME": str(cache), "TMPDIR": str(scratch)})
    seen = bytearray()
    try:
        _wait_for_output(proc.stdout, rb"\[cold\]", 240, seen)
        time.sleep(1.0)  # into the cold prefill
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    code, out, err = _interrupt(proc)
    assert code == 130, (code, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "kvstore demo: interrupted; the daemon stopped;" in err, err
    assert f"stay in {cache / 'kvstore' / 'demo' / 'blocks'}" in err or "nothing was kept" in err, err
    assert list(scratch.glob("kvstore-demo-*")) == [], "the demo's daemon folder (socket, log) is removed"


# -- 6. benchmarks check their inputs ----------------------------------------------------------------


@pytest.mark.parametrize("bench", ["codec_quality.py", "reuse_vs_rag.py"])
def test_a_benchmark_without_its_data_file_says_so_in_one_line(bench, short_tmp):
    """`bench/codec_quality.py` loaded the model and then died with a traceback on a missing data
    file; every bench that reads MuSiQue now names the file and where it comes from, before any work."""
    missing = short_tmp / "missing.json"
    not_json = short_tmp / "not.json"
    not_json.write_text("passages\n")
    for path, reason in ((missing, "No such file or directory"), (not_json, "not JSON")):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--data", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
        assert lines[0].startswith(f"{bench}: --data {path}: {reason}") and "MuSiQue" in lines[0], lines[0]


# -- 8. help in the user's words, and an unbounded tier ---------------------------------------------


def test_every_serve_setting_is_described_in_words():
    """`serve --help` showed `--shm-index`'s help as "shm_index"; every DaemonConfig field needs an
    entry in kvstore/cli.py's _FIELD_HELP, and defaults read as a user writes them."""
    from kvstore.cli import _FIELD_HELP
    from kvstore.daemon.config import field_names

    assert [name for name in field_names() if name not in _FIELD_HELP] == []
    code, out, err = finish(kvstore("serve", "--help"))
    assert code == 0, err
    text = " ".join(out.split())
    for name in field_names():
        assert f" {name}; env" not in text, f"--{name.replace('_', '-')} is described by its code name"
    assert "default: True" not in text and "default: False" not in text and "default: 2147483648" not in text
    assert "(default: 2GiB)" in text and "(default: true)" in text


def test_calibrate_help_shows_its_defaults_as_numbers():
    """`kvstore calibrate --help` said "default: compression.calibrate.DEFAULT_ALLOCATION"."""
    from engine_adapter.calibrate import DEFAULT_ALLOCATION, SENSITIVITY_LIMIT
    from kvstore.cli import CALIBRATE_DEFAULTS

    assert CALIBRATE_DEFAULTS == {"key_step": DEFAULT_ALLOCATION.key_step, "value_step": DEFAULT_ALLOCATION.value_step,
                                  "sink_tokens": DEFAULT_ALLOCATION.sink_tokens, "sensitivity_limit": SENSITIVITY_LIMIT}
    code, out, err = finish(kvstore("calibrate", "--help"))
    assert code == 0, err
    text = " ".join(out.split())
    assert "compression.calibrate" not in text and "DEFAULT_ALLOCATION" not in text
    for flag, value in (("step of keys", DEFAULT_ALLOCATION.key_step), ("step of values", DEFAULT_ALLOCATION.value_step),
                        ("LIMIT]", SENSITIVITY_LIMIT)):
        assert re.search(rf"{re.escape(flag)}.{{0,40}}\(default {value}\)", text), (flag, text)


def test_stats_shows_an_unbounded_tier_as_unbounded(daemon_factory, moto_server, s3_bucket):
    """An S3 tier without s3_capacity is unbounded: `kvstore stats` said "0 B"."""
    d = daemon_factory(s3_bucket=s3_bucket, s3_endpoint=moto_server.url, **SMALL)
    code, out, err = finish(kvstore("stats", "--address", d.address))
    assert code == 0, err
    header, *lines = out.splitlines()
    end = header.index("capacity") + len("capacity")  # the column is right-aligned under its name
    capacity = {line.split()[0]: line[end - 12 : end].strip() for line in lines if line[:1].isalpha()}
    assert capacity["s3"] == "unbounded" and capacity["cpu"] == "16.0 MiB", out
