"""The deployment files in docs/deploy are what they say (issue #40): the systemd unit and the
Kubernetes sidecar example pass only flags `kvstore serve --help` lists and only KVSTORE_* variables
that are settings, their paths and volumes fit together, their memory limits cover the daemon's
budget (docs/guarantees.md, "The daemon's memory stays within a budget"; docs/deploy/README.md,
"Sizing"), and a real daemon started with their settings answers every probe path they name."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path, PurePosixPath

import pytest
import yaml

from kvstore.daemon.auth import read_tenants
from kvstore.daemon.config import ENV_PREFIX, DaemonConfig, field_names, load_config
from kvstore.host import is_loopback_host
from kvstore.daemon.promotion import MAX_PROMOTING_BYTES
from tests.conftest import ROOT, free_port

DEPLOY = ROOT / "docs" / "deploy"
UNIT = DEPLOY / "kvstore.service"
ENV_FILE = DEPLOY / "kvstore.env"
POD = DEPLOY / "kubernetes-vllm-sidecar.yaml"
SIZING = DEPLOY / "README.md"

MiB = 2**20
GiB = 2**30
#: The process itself, beyond its tiers and arenas (docs/deploy/README.md, "Sizing"; about
#: 250 MiB resident when idle: test_a_daemon_with_the_units_settings_answers_its_probes checks).
PROCESS_BYTES = 512 * MiB
#: The key index: bytes per block the tiers can hold, and its smallest table (kvstore/shm_index.py).
INDEX_BYTES_PER_BLOCK = 320
INDEX_MIN_BYTES = 256 + 4096 * 32
#: The smallest block any sizing here assumes (4 KiB of KV per token x 256 tokens; every model in
#: docs/deploy/README.md has more), so the most blocks a tier can hold.
SMALLEST_BLOCK = 1 * MiB
#: Settings that name a file or folder the daemon writes or reads.
PATH_SETTINGS = ("disk_path", "tenant_secret_file", "calibration_dir", "tenants_file", "tls_cert", "tls_key",
                 "admin_token_file")


# -- parsing ------------------------------------------------------------------------------------


def unit_entries(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit file as {section: [(key, value), ...]}: comments dropped, lines ending in a
    backslash joined, repeated keys kept in order (configparser would keep only the last)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    section, pending = None, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            sections.setdefault(section, [])
            continue
        key, sep, value = line.partition("=")
        assert sep and section is not None, f"{UNIT.name}: not a key=value line in a section: {line!r}"
        sections[section].append((key.strip(), value.strip()))
    assert not pending, f"{UNIT.name}: the last line ends in a backslash"
    return sections


def unit_value(entries: list[tuple[str, str]], key: str) -> str | None:
    values = [v for k, v in entries if k == key]
    return values[-1] if values else None


def systemd_bytes(value: str) -> int:
    """MemoryMax=-style sizes: bytes, or K, M, G, T (powers of 1024)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value.strip())
    assert match, f"MemoryMax={value}: not a size (a percentage or infinity sets no budget)"
    return int(float(match.group(1)) * 1024 ** " KMGT".index(match.group(2) or " "))


def systemd_seconds(value: str) -> float:
    """TimeoutStopSec=-style times: 90, 90s, 3min, 1min 30s."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts and all(u in units for _, u in parts), f"TimeoutStopSec={value}: not a time span"
    return sum(float(n) * units[u] for n, u in parts)


def quantity_bytes(value: str | int) -> int:
    """A Kubernetes quantity (10Gi, 512Mi, 1G, 1e9, 1024) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(value).strip())
    assert match, f"{value!r}: not a Kubernetes quantity"
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[match.group(2)]
    return int(float(match.group(1)) * scale)


def serve_flags(argv: list[str], where: str) -> dict[str, str]:
    """{flag: value} of the --flag VALUE (or --flag=VALUE) pairs after `kvstore serve`."""
    assert "serve" in argv, f"{where}: no `kvstore serve` in {argv}"
    rest = argv[argv.index("serve") + 1:]
    flags: dict[str, str] = {}
    while rest:
        arg = rest.pop(0)
        assert arg.startswith("--"), f"{where}: {arg!r} is not a flag (kvstore serve takes --flag VALUE pairs)"
        if "=" in arg:
            name, value = arg.split("=", 1)
        else:
            assert rest, f"{where}: {arg} has no value"
            name, value = arg, rest.pop(0)
        assert name not in flags, f"{where}: {name} given twice"
        flags[name] = value
    return flags


@lru_cache(maxsize=1)
def serve_help() -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def help_flags() -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", serve_help()))


def check_flags(flags: dict[str, str], where: str) -> dict[str, str]:
    """Each flag is one `kvstore serve --help` lists and one of DaemonConfig's fields; returns
    {field: value}."""
    known = help_flags()
    unknown = sorted(set(flags) - known)
    assert not unknown, f"{where} passes flags `kvstore serve --help` does not list: {unknown}"
    settings = {name[2:].replace("-", "_"): value for name, value in flags.items()}
    not_fields = sorted(set(settings) - set(field_names()) - {"config"})
    assert not not_fields, f"{where}: {not_fields} are not DaemonConfig settings"
    return settings


def check_variables(names: list[str], where: str) -> dict[str, str]:
    """Each KVSTORE_* name is a setting's variable; returns {variable: field}."""
    fields = {ENV_PREFIX + name.upper(): name for name in field_names()}
    unknown = sorted(n for n in names if n.startswith(ENV_PREFIX) and n not in fields)
    assert not unknown, f"{where} sets variables that are no kvstore setting: {unknown}"
    return {n: fields[n] for n in names if n in fields}


def memory_budget(config: DaemonConfig) -> int:
    """What the daemon may hold in memory: docs/deploy/README.md's formula ("Memory limit")."""
    return (config.cpu_capacity + config.max_arena_total_bytes + MAX_PROMOTING_BYTES
            + (config.max_inline_bytes or config.max_message_bytes) + 2 * config.max_message_bytes
            + PROCESS_BYTES)


def index_bytes(config: DaemonConfig) -> int:
    """An upper bound on the key index's /dev/shm files for these tiers."""
    blocks = (config.cpu_capacity + (config.disk_capacity if config.disk_path else 0)
              + config.s3_capacity) // SMALLEST_BLOCK
    return 2 * INDEX_MIN_BYTES + INDEX_BYTES_PER_BLOCK * blocks


def inside(path: str, folder: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(folder) or PurePosixPath(folder) in PurePosixPath(path).parents


def http_status(port: int, path: str, deadline_s: float = 10.0) -> tuple[int, str]:
    """The status of GET path on 127.0.0.1:port, retried (a connection refused or a 503) until the
    deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                return reply.status, reply.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read().decode(errors="replace")
        except OSError as exc:
            status, body = 0, str(exc)
        if time.monotonic() > deadline:
            return status, body
        time.sleep(0.2)


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def moved_settings(settings: dict[str, str], folder: Path, keep: tuple[str, ...] = ()) -> dict[str, str]:
    """A deployment's settings for a daemon in a test folder: its own socket (the factory's), the
    factory's small tiers (the sizes are checked against the limits, not allocated here), and every
    path moved under ``folder`` (parents made 0700, as the daemon makes its own)."""
    moved = {}
    for name, value in settings.items():
        if name in ("listen", "cpu_capacity", "disk_capacity", "gpu_capacity") or name in keep:
            continue
        if name in PATH_SETTINGS and value.startswith("/"):
            value = str(folder / "root" / value.lstrip("/"))
            os.makedirs(os.path.dirname(value), mode=0o700, exist_ok=True)
        moved[name] = value
    return moved


# -- the systemd unit ---------------------------------------------------------------------------


def unit() -> dict[str, list[tuple[str, str]]]:
    return unit_entries(UNIT.read_text())


def unit_serve(entries) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The unit's ExecStart argv, its serve settings {field: value}, and its environment."""
    service = entries["Service"]
    starts = [v for k, v in service if k == "ExecStart"]
    assert len(starts) == 1, "one ExecStart="
    argv = shlex.split(starts[0])
    settings = check_flags(serve_flags(argv, f"{UNIT.name} ExecStart"), f"{UNIT.name} ExecStart")
    environment = {}
    for key, value in service:
        if key == "Environment":
            for assignment in shlex.split(value):
                name, sep, val = assignment.partition("=")
                assert sep, f"{UNIT.name}: Environment={value!r} is not NAME=VALUE"
                environment[name] = val
    return argv, settings, environment


def test_the_unit_passes_only_real_flags_and_variables():
    """ExecStart runs `kvstore serve` with flags `kvstore serve --help` lists; every KVSTORE_*
    variable in the unit and in its example EnvironmentFile (kvstore.env, commented ones too) is a
    setting; the values load (a bad size or combination is the ValueError `kvstore serve` exits with)."""
    entries = unit()
    argv, settings, environment = unit_serve(entries)
    assert PurePosixPath(argv[0]).name == "kvstore" and argv[1] == "serve", argv[:2]
    variables = check_variables(list(environment), f"{UNIT.name} Environment=")
    env_file_names = re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", ENV_FILE.read_text(), re.MULTILINE)
    assert any(n.startswith(ENV_PREFIX) for n in env_file_names)
    check_variables(env_file_names, ENV_FILE.name)
    env_files = [v for k, v in entries["Service"] if k == "EnvironmentFile"]
    assert env_files and all(v.startswith("-/etc/") for v in env_files), \
        "EnvironmentFile= is optional ('-') and root's (/etc)"
    config = load_config(None, settings, environ={n: environment[n] for n in variables})
    assert config.listen.startswith("unix:") and not config.auth_token


def test_the_unit_writes_only_its_own_directories_and_restarts_on_failure():
    """RuntimeDirectory= holds the socket; every path the daemon writes (socket, disk tier, tenant
    secret, calibrations, kvstore's default cache folder) lies in the runtime, cache or state
    directory, the only ones ProtectSystem=strict leaves writable; restart, stop timeout and
    hardening as docs/deploy/README.md says."""
    entries = unit()
    service = entries["Service"]
    _, settings, environment = unit_serve(entries)
    runtime, cache, state = (unit_value(service, k) for k in ("RuntimeDirectory", "CacheDirectory", "StateDirectory"))
    assert runtime and cache and state
    writable = [f"/run/{runtime}", f"/var/cache/{cache}", f"/var/lib/{state}"]
    writable += [p.lstrip("-") for k, v in service if k == "ReadWritePaths" for p in v.split()]
    listen = settings["listen"]
    assert listen.startswith("unix:") and inside(listen[len("unix:"):], f"/run/{runtime}"), \
        f"the socket {listen} is not in RuntimeDirectory=/run/{runtime}"
    written = {name: settings[name] for name in ("disk_path", "tenant_secret_file", "calibration_dir")}
    written["kvstore's default cache folder"] = os.path.join(environment.get("XDG_CACHE_HOME", "/nonexistent"),
                                                             "kvstore")
    for name, path in written.items():
        assert any(inside(path, folder) for folder in writable), f"{name} {path} is not writable under {writable}"

    assert unit_value(service, "Restart") == "on-failure"
    assert systemd_seconds(unit_value(service, "TimeoutStopSec") or "0") >= 60, "a stop drains write-behind queues"
    assert unit_value(service, "NoNewPrivileges") == "yes"
    assert unit_value(service, "ProtectSystem") == "strict"
    assert unit_value(service, "PrivateDevices") in (None, "no"), "it would hide the GPUs a GPU tier needs"
    user = unit_value(service, "User")
    assert user and user not in ("root", "0"), "the daemon runs as its own user (the engine runs as it too)"
    assert unit_value(service, "Type") in ("exec", "simple"), "kvstore sends no sd_notify readiness"


def test_the_units_memory_max_covers_the_daemons_budget():
    """MemoryMax >= CPU tier + all clients' arenas (the daemon allocates their pages) + the request
    allowance of docs/guarantees.md + the process (docs/deploy/README.md's formula)."""
    entries = unit()
    _, settings, _ = unit_serve(entries)
    config = load_config(None, settings, environ={})
    memory_max = systemd_bytes(unit_value(entries["Service"], "MemoryMax") or "")
    assert memory_max >= memory_budget(config), \
        f"MemoryMax {memory_max / GiB:.2f} GiB < the daemon's budget {memory_budget(config) / GiB:.2f} GiB"
    assert config.cpu_capacity + config.max_arena_total_bytes <= memory_max


def test_systemd_reads_the_unit_without_complaint():
    """`systemd-analyze verify` knows every key and section (the executable is not installed here)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    done = subprocess.run([tool, "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines()
                  if line.strip() and "is not executable" not in line and "Failed to resolve user" not in line]
    assert not complaints, "\n".join(complaints)


def test_a_daemon_with_the_units_settings_answers_its_probes(daemon_factory, short_tmp):
    """A real daemon with the unit's flags and variables (paths moved into a test folder, small
    tiers) starts, answers /healthz and /readyz on its metrics address (loopback, as in the unit),
    and stays within the process allowance the memory formula gives it."""
    _, settings, environment = unit_serve(unit())
    variables = check_variables(list(environment), UNIT.name)
    settings = {**{field: environment[name] for name, field in variables.items()}, **settings}
    port = free_port()
    metrics_host = settings["metrics_listen"].rpartition(":")[0]
    settings = moved_settings(settings, short_tmp)
    settings["metrics_listen"] = f"{metrics_host}:{port}"
    daemon = daemon_factory("unit", **settings)
    for path in ("/healthz", "/readyz"):
        status, body = http_status(port, path)
        assert status == 200, f"{path}: {status} {body}"
    cpu = load_config(None, {"cpu_capacity": "64MiB"}, environ={}).cpu_capacity  # the factory's CPU tier
    assert resident_bytes(daemon.proc.pid) - cpu < PROCESS_BYTES


# -- the Kubernetes example ---------------------------------------------------------------------


def pod_documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(POD.read_text()) if d]


def pod_spec(documents: list[dict]) -> dict:
    workloads = [d for d in documents if d["kind"] in ("Pod", "Deployment", "StatefulSet", "DaemonSet")]
    assert len(workloads) == 1, "one workload"
    workload = workloads[0]
    return workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]


def argv_of(container: dict) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def pod_parts(spec: dict) -> tuple[dict, dict, dict[str, str], dict]:
    """(kvstore container, vLLM container, kvstore's serve settings, vLLM's kv-transfer-config)."""
    containers = spec.get("initContainers", []) + spec["containers"]
    kvstores = [c for c in containers if "serve" in argv_of(c) and any(PurePosixPath(a).name == "kvstore"
                                                                     for a in argv_of(c))]
    vllms = [c for c in containers if "--kv-transfer-config" in argv_of(c)]
    assert len(kvstores) == 1 and len(vllms) == 1, "one kvstore container and one vLLM container"
    kvstore, vllm = kvstores[0], vllms[0]
    where = f"{POD.name} container {kvstore['name']}"
    settings = check_flags(serve_flags(argv_of(kvstore), where), where)
    env = [e["name"] for e in kvstore.get("env", [])]
    check_variables(env, where)
    argv = argv_of(vllm)
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return kvstore, vllm, settings, transfer


def mount_for(container: dict, path: str) -> dict | None:
    """The volume mount of ``container`` that holds ``path`` (the deepest)."""
    mounts = [m for m in container.get("volumeMounts", []) if inside(path, m["mountPath"])]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


def volume(spec: dict, name: str) -> dict:
    return next(v for v in spec["volumes"] if v["name"] == name)


def secret_file(documents: list[dict], spec: dict, container: dict, path: str) -> tuple[str, int]:
    """(content, mode) of the Secret key mounted at ``path`` in ``container``: the mount is read-only,
    the Secret is in the file."""
    mount = mount_for(container, path)
    assert mount is not None, f"{path} is not on a volume of {container['name']}"
    assert mount.get("readOnly") is True, f"{mount['mountPath']} is not mounted read-only"
    source = volume(spec, mount["name"]).get("secret")
    assert source is not None, f"{path} is not on a Secret volume"
    relative = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    items = {i["path"]: i for i in source.get("items", [])}
    item = items.get(relative, {"key": relative})
    mode = item.get("mode", source.get("defaultMode", 0o644))
    secret = next(d for d in documents if d["kind"] == "Secret" and d["metadata"]["name"] == source["secretName"])
    content = secret.get("stringData", {}).get(item["key"])
    assert content is not None, f"the Secret {source['secretName']} has no {item['key']}"
    return content, mode


def connector_fields() -> dict[str, str]:
    """kv_connector_extra_config keys the connector takes: ConnectorSettings' fields and their types,
    read from its source (importing it needs vLLM)."""
    tree = ast.parse((ROOT / "engine_adapter" / "vllm" / "connector.py").read_text())
    settings = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ConnectorSettings")
    return {n.target.id: ast.unparse(n.annotation) for n in settings.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_the_pod_passes_only_real_flags_and_the_connector_config_vllm_needs():
    """The kvstore container's flags are `kvstore serve --help`'s and its KVSTORE_* variables are
    settings; vLLM's --kv-transfer-config names the connector's class and module (as in the README),
    keeps kv_load_failure_policy at recompute, passes only keys the connector knows, with their types,
    points at the kvstore container's socket, and asks for an arena the daemon's caps admit."""
    spec = pod_spec(pod_documents())
    kvstore, vllm, settings, transfer = pod_parts(spec)
    assert transfer["kv_connector"] == "KVStoreConnector"
    module = ROOT / (transfer["kv_connector_module_path"].replace(".", "/") + ".py")
    assert module.is_file() and "class KVStoreConnector" in module.read_text()
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_role"] in ("kv_both", "kv_producer", "kv_consumer")
    extra = transfer["kv_connector_extra_config"]
    known = connector_fields()
    assert set(extra) <= set(known), f"unknown kv_connector_extra_config keys {sorted(set(extra) - set(known))}"
    for key, value in extra.items():
        assert type(value).__name__ == known[key], f"{key}: {value!r} is not a {known[key]}"
    assert extra["address"] == settings["listen"], "vLLM's connector and the daemon name one socket"

    config = load_config(None, {k: v for k, v in settings.items() if k != "tenants_file"}, environ={})
    arena = extra.get("arena_bytes", 64 * MiB)
    assert arena <= config.max_arena_bytes, "the worker's arena is within --max-arena-bytes"
    assert arena + MiB <= config.max_arena_total_bytes, "the worker's and the scheduler's arenas fit the total"
    if kvstore in spec.get("initContainers", []):
        assert kvstore.get("restartPolicy") == "Always", "an init container that is not a sidecar never ends"


def test_the_pods_containers_share_the_socket_and_dev_shm_as_one_user():
    """The socket's folder is an emptyDir both containers mount; /dev/shm is one memory-backed
    emptyDir in both (the daemon's key index is read there), sized above the key index's bound;
    both run as one user (socket, arenas and index are the daemon's user's only), in one pid
    namespace (arena caps per client process)."""
    spec = pod_spec(pod_documents())
    kvstore, vllm, settings, _ = pod_parts(spec)
    socket = settings["listen"][len("unix:"):]
    mounts = [mount_for(c, socket) for c in (kvstore, vllm)]
    assert all(mounts) and mounts[0]["name"] == mounts[1]["name"] and mounts[0]["mountPath"] == mounts[1]["mountPath"]
    assert "emptyDir" in volume(spec, mounts[0]["name"])

    shm = [next((m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"), None) for c in (kvstore, vllm)]
    assert all(shm) and shm[0]["name"] == shm[1]["name"], "one /dev/shm for both containers"
    dshm = volume(spec, shm[0]["name"])["emptyDir"]
    assert dshm.get("medium") == "Memory", "/dev/shm is memory-backed"
    config = load_config(None, {k: v for k, v in settings.items() if k != "tenants_file"}, environ={})
    assert quantity_bytes(dshm["sizeLimit"]) >= index_bytes(config), "/dev/shm holds the key index"

    def uid(container: dict):
        return container.get("securityContext", {}).get("runAsUser", spec.get("securityContext", {}).get("runAsUser"))

    assert uid(kvstore) == uid(vllm) and (uid(kvstore) is not None or kvstore["image"] == vllm["image"])
    assert spec.get("shareProcessNamespace") is True, "without it every vLLM process is pid 0 to the daemon"
    assert spec.get("terminationGracePeriodSeconds", 30) >= 60, "a stop drains write-behind queues"


def test_the_pods_kvstore_writes_only_to_its_volumes():
    """With a read-only root file system, every path the daemon writes (disk tier, calibrations,
    tenant secret, kvstore's default cache folder for native code) is on a writable volume of its
    container."""
    spec = pod_spec(pod_documents())
    kvstore, _, settings, _ = pod_parts(spec)
    if not kvstore.get("securityContext", {}).get("readOnlyRootFilesystem"):
        pytest.skip("the kvstore container's root file system is writable")
    env = {e["name"]: e.get("value", "") for e in kvstore.get("env", [])}
    cache = os.path.join(env.get("XDG_CACHE_HOME", "/root/.cache"), "kvstore")
    written = {"disk_path": settings["disk_path"],
               "calibration_dir": settings.get("calibration_dir", "/root/.cache/kvstore/calibrations"),
               "tenant_secret_file": settings.get("tenant_secret_file", os.path.join(cache, "tenant-secret")),
               "the native code folder": os.path.join(cache, "native"), "the compiler's temp files": "/tmp/x"}
    for name, path in written.items():
        mount = mount_for(kvstore, path)
        assert mount is not None and not mount.get("readOnly"), f"{name} {path} is not on a writable volume"


def test_the_pods_tenants_secret_is_read_only_0400_and_holds_vllms_token(tmp_path):
    """--tenants-file is a Secret key mounted read-only with mode 0400 into kvstore alone, and the file
    it holds is a tenants file the daemon reads; vLLM's token_file is a Secret key mounted 0400 into
    vLLM alone, holding one of those tenants' tokens."""
    documents = pod_documents()
    spec = pod_spec(documents)
    kvstore, vllm, settings, transfer = pod_parts(spec)
    tenants_text, mode = secret_file(documents, spec, kvstore, settings["tenants_file"])
    assert mode == 0o400, f"the tenants file is mounted with mode {mode:o}, not 400"
    assert mount_for(vllm, settings["tenants_file"]) is None, "vLLM does not see the tenants file"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_text)
    tenants.chmod(0o600)
    tokens = {token for _, token, _ in read_tenants(tenants)}
    token_path = transfer["kv_connector_extra_config"]["token_file"]
    token, mode = secret_file(documents, spec, vllm, token_path)
    assert mode == 0o400, f"vLLM's token file is mounted with mode {mode:o}, not 400"
    assert mount_for(kvstore, token_path) is None, "kvstore does not see vLLM's token file"
    assert token.strip() in tokens, "vLLM's token is a tenant's"
    load_config(None, {**{k: v for k, v in settings.items() if k != "tenants_file"}, "tenants_file": str(tenants)},
                environ={})


def test_the_pods_resources_cover_the_tiers():
    """kvstore's memory request and limit >= its budget (CPU tier + arenas + allowance + process);
    the disk tier's emptyDir sizeLimit stays 5% above --disk-capacity (the kubelet evicts a pod past
    it) and its ephemeral-storage request covers it."""
    spec = pod_spec(pod_documents())
    kvstore, _, settings, _ = pod_parts(spec)
    config = load_config(None, {k: v for k, v in settings.items() if k != "tenants_file"}, environ={})
    resources = kvstore["resources"]
    for kind in ("requests", "limits"):
        memory = quantity_bytes(resources[kind]["memory"])
        assert memory >= memory_budget(config), \
            f"{kind}.memory {memory / GiB:.2f} GiB < the daemon's budget {memory_budget(config) / GiB:.2f} GiB"
    disk = mount_for(kvstore, settings["disk_path"])
    assert disk is not None, f"--disk-path {settings['disk_path']} is not on a volume"
    source = volume(spec, disk["name"])
    if "emptyDir" in source:
        limit = quantity_bytes(source["emptyDir"]["sizeLimit"])
        assert limit >= 1.05 * config.disk_capacity, \
            f"the disk tier's emptyDir sizeLimit {limit / GiB:.1f} GiB is not 5% above --disk-capacity"
        assert quantity_bytes(resources["requests"]["ephemeral-storage"]) >= config.disk_capacity, \
            "kvstore's ephemeral-storage request does not cover its disk tier"


def test_every_probe_of_the_pod_answers_on_a_real_daemon(daemon_factory, short_tmp, tmp_path):
    """kvstore's probes are httpGet on its metrics port, which listens on the pod's address (the
    kubelet probes from the node) with --metrics-public; a real daemon with the container's settings
    (its tenants file from the Secret, paths moved into a test folder, small tiers) answers 200 on
    every probe path."""
    documents = pod_documents()
    spec = pod_spec(documents)
    kvstore, _, settings, _ = pod_parts(spec)
    host, _, port = settings["metrics_listen"].rpartition(":")
    assert host and not is_loopback_host(host), "kubelet probes come from the node, not from loopback"
    assert settings.get("metrics_public") == "true"
    ports = {p["name"]: p["containerPort"] for p in kvstore.get("ports", []) if "name" in p}
    probes = {kind: kvstore[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in kvstore}
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    paths = set()
    for kind, probe in probes.items():
        assert "httpGet" in probe, f"{kind}: an httpGet probe"
        target = probe["httpGet"]["port"]
        assert ports.get(target, target) == int(port), f"{kind} probes port {target}, the metrics port is {port}"
        paths.add(probe["httpGet"]["path"])
    assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"

    tenants_text, _ = secret_file(documents, spec, kvstore, settings["tenants_file"])
    moved = moved_settings(settings, short_tmp, keep=("tenants_file",))
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_text)
    tenants.chmod(0o600)
    local = free_port()
    daemon_factory("pod", **{**moved, "tenants_file": str(tenants), "metrics_listen": f"{host}:{local}"})
    for path in sorted(paths):
        status, body = http_status(local, path)
        assert status == 200, f"{path}: {status} {body}"


# -- docs ---------------------------------------------------------------------------------------


def test_the_sizing_example_is_the_bundled_models_kv():
    """docs/deploy/README.md's KV bytes per token of SmolLM2-135M in fp32 is what its GGUF says:
    layers x 2 x KV heads x head_dim x 4."""
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config

    config, _ = gguf_config(find_smollm2_gguf())
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    text = SIZING.read_text()
    assert f"{per_token:,}" in text
    assert f"{config.num_layers} x 2 x {config.num_kv_heads} x {config.head_dim} x 4" in text


# -- the images (Dockerfile) ----------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile as {stage name: [(instruction, arguments), ...]}, continuation lines joined."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        current.append((instruction.upper(), rest.strip()))
    return stages


def test_the_images_copy_every_package_and_run_as_a_numeric_non_root_user():
    """Each folder pyproject.toml installs is copied into the build; both final images drop root
    by number (a pod's `runAsNonRoot` needs one), and the pod names the images the file builds."""
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    copied = {source.rstrip("/") for op, args in dockerfile_stages()["build"] if op == "COPY"
              for source in args.split()[:-1]}
    assert {name.split(".")[0] for name in packages} <= copied
    assert {"pyproject.toml", "README.md", "LICENSE"} <= copied
    ignored = (ROOT / ".dockerignore").read_text()
    assert all(f"!{name}" in ignored for name in copied - {"pyproject.toml", "README.md", "LICENSE"} | {"kernels"})
    for stage in ("daemon", "vllm"):
        users = [args for op, args in dockerfile_stages()[stage] if op == "USER"]
        assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), f"{stage} ends as a numeric non-root user"
    tags = re.findall(r"--target (\w+)\s+-t (\S+)", DOCKERFILE.read_text())
    images = {c["name"]: c["image"] for c in [*pod_spec(pod_documents())["initContainers"],
                                              *pod_spec(pod_documents())["containers"]]}
    assert dict(tags) == {"daemon": images["kvstore"], "vllm": images["vllm"]}


def test_prebuilt_kernels_load_where_there_is_no_compiler(tmp_path, monkeypatch):
    """`python -m kernels.native` (the image's build step) compiles every kernel into the package;
    `build` then loads each from there with no compiler on PATH, as in the daemon image."""
    from kernels import native

    monkeypatch.setattr(native, "PREBUILT", tmp_path)
    built = native.prebuild()
    assert {p.name.rsplit("-", 1)[0] for p in built} == {c.stem for c in (ROOT / "kernels").glob("*.c")}
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    for source in (ROOT / "kernels").glob("*.c"):
        library = native.build.__wrapped__(source, "test")
        assert library is not None and Path(library._name).parent == tmp_path


# -- the dashboard and alert rules --------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana-kvstore.json"
ALERTS = DEPLOY / "kvstore-alerts.yml"
#: Labels Prometheus adds to every scraped series, and a histogram's bucket bound.
SCRAPE_LABELS = {"instance", "job", "le"}


def monitoring_expressions() -> dict[str, str]:
    """{where: PromQL} for every expression of the Grafana dashboard and the alert rules."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = {f"dashboard panel {p['title']!r} {t['refId']}": t["expr"] for p in dashboard["panels"]
             for t in p["targets"]}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found[f"dashboard variable {variable['name']}"] = variable["definition"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        found.update({f"alert {r['alert']}": r["expr"] for r in group["rules"]})
    return found


def test_every_series_the_dashboard_and_alerts_name_is_on_a_live_daemons_metrics(daemon_factory):
    """Each kvstore_* series in docs/deploy/grafana-kvstore.json and kvstore-alerts.yml is one a
    real daemon's /metrics exposes (a counter's _total, a histogram's _bucket/_count/_sum), and
    each label it groups or matches by is one that metric has."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine_adapter.client.kvstore_client import KVStoreClient
    from kvstore.daemon.metrics import Metrics
    from tests.test_daemon import BLOCK, NS, make_blocks

    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    keys, payloads = make_blocks(2, seed=575)
    with KVStoreClient(d.address, shared_memory=False) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        client.get(keys, BLOCK)
        client.lookup(keys)
    status, text = http_status(port, "/metrics")
    assert status == 200
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    series = {f.name + suffix for f in text_string_to_metric_families(text) for suffix in suffixes.get(f.type, ("",))}
    labels = {m._name: set(m._labelnames) for m in vars(Metrics()).values() if hasattr(m, "_labelnames")}
    expressions = monitoring_expressions()
    assert len(expressions) >= 15
    for where, expr in expressions.items():
        names = set(re.findall(r"\bkvstore_[a-z_]+\b", expr))
        assert names or "up{" in expr, f"{where}: names no kvstore series"
        for name in names:
            assert name in series, f"{where}: {name} is not on /metrics"
        allowed = SCRAPE_LABELS.union(*(labels[re.sub(r"_(total|bucket|count|sum)$", "", n)] for n in names))
        used = set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)\s*\"", expr)) | {
            label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in group.split(",")}
        assert used <= allowed, f"{where}: labels {sorted(used - allowed)} are not {sorted(names)}'s"


def test_promtool_accepts_the_alert_rules():
    """`promtool check rules` (Debian's prometheus package), where it is installed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
