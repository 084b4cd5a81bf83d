"""Every client reaches every daemon it is allowed to: TLS, tokens from the environment or a file,
per-host tokens for `locate`, no token in plaintext to a remote host, and one line saying why a
daemon cannot be used. Real daemons, and the CLI as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.keys import prefix_keys
from kvstore.connect import TokenBook
from kvstore.locate import locate
from tests.conftest import free_port
from tests.test_daemon import NS, make_blocks
from tests.test_security import _self_signed

TOKEN = "client-token-0123456789"      # the daemon refuses tokens shorter than 16 characters
OTHER_TOKEN = "other-token-9876543210"
REMOTE = "192.0.2.1:7070"              # TEST-NET-1: not loopback, never answers


def kvstore(*args, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``kvstore ARGS`` as a subprocess, with no KVSTORE_* variable but those in ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**clean, **(env or {})})


def one_line(out: subprocess.CompletedProcess) -> str:
    """The failed command's only line on stderr."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def secret_file(path, text: str):
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def certificate(short_tmp):
    """A self-signed certificate for localhost and 127.0.0.1 (its own CA) and its key."""
    folder = short_tmp / "tls"
    folder.mkdir()
    return _self_signed(folder)


def tls_daemon(daemon_factory, certificate, name="tls", token=TOKEN):
    cert, key = certificate
    return daemon_factory(name, listen=f"127.0.0.1:{free_port()}", auth_token=token, tls_cert=cert, tls_key=key)


def test_stats_and_clear_over_tls_with_a_ca_and_no_token_on_the_command_line(daemon_factory, certificate, short_tmp):
    """Before: `--tls-ca` and `--token-file` were unknown (exit 2), and a plaintext `stats` met the
    README's TLS daemon with a raw 'Socket closed'."""
    cert, _ = certificate
    daemon = tls_daemon(daemon_factory, certificate)
    keys, payloads = make_blocks(2, seed=71)
    with KVStoreClient(daemon.address, token=TOKEN, tls_ca=str(cert)) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    # CA and token from the environment
    out = kvstore("stats", "--address", daemon.address, "--json",
                  env={"KVSTORE_TLS_CA": str(cert), "KVSTORE_AUTH_TOKEN": TOKEN})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tiers"]["cpu"]["blocks"] == 2
    # CA and token from flags and a file; a client certificate where the daemon asks for none
    client_folder = short_tmp / "client"
    client_folder.mkdir()
    client_cert, client_key = _self_signed(client_folder)
    token_file = secret_file(short_tmp / "token", TOKEN + "\n")
    out = kvstore("clear", "--tier", "cpu", "--address", daemon.address, "--tls-ca", cert, "--token-file", token_file,
                  "--tls-cert", client_cert, "--tls-key", client_key)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cleared 2 blocks"
    line = one_line(kvstore("stats", "--address", daemon.address, "--tls-ca", cert, "--tls-cert", client_cert,
                            env={"KVSTORE_AUTH_TOKEN": TOKEN}))
    assert line == "kvstore: a TLS client certificate needs its private key too (and the key its certificate)"


def test_a_client_meeting_the_other_kind_of_port_says_so_in_one_line(daemon_factory, certificate, short_tmp):
    """Plaintext meets TLS, TLS meets plaintext, a CA that did not sign the certificate, a name the
    certificate does not carry, a refused token: each one line with its fix. Before: 'Socket
    closed' or the flags were unknown."""
    cert, _ = certificate
    secure = tls_daemon(daemon_factory, certificate)
    plain = daemon_factory("plain", listen=f"127.0.0.1:{free_port()}", auth_token=TOKEN)
    other_folder = short_tmp / "other-ca"
    other_folder.mkdir()
    other_ca, _ = _self_signed(other_folder)
    env = {"KVSTORE_AUTH_TOKEN": TOKEN}
    assert one_line(kvstore("stats", "--address", secure.address, env=env)) == \
        f"kvstore: {secure.address} speaks TLS: pass --tls-ca (or KVSTORE_TLS_CA)"
    assert one_line(kvstore("stats", "--address", plain.address, "--tls-ca", cert, env=env)) == \
        f"kvstore: {plain.address} does not speak TLS (it answers in plaintext): drop --tls-ca (or KVSTORE_TLS_CA)"
    line = one_line(kvstore("stats", "--address", secure.address, "--tls-ca", other_ca, env=env))
    assert line.startswith(f"kvstore: {secure.address}: its TLS certificate is not signed by the CA given (")
    assert line.endswith("pass that CA as --tls-ca (or KVSTORE_TLS_CA)")
    line = one_line(kvstore("stats", "--address", secure.address, "--tls-ca", cert, "--tls-server-name",
                            "kvstore.example", env=env))
    assert line.startswith(f"kvstore: {secure.address}: its TLS certificate is not for kvstore.example (")
    assert one_line(kvstore("stats", "--address", plain.address)) == \
        (f"kvstore: {plain.address} refused the bearer token (none was given): pass the daemon's token with "
         f"--token-file FILE or KVSTORE_AUTH_TOKEN")
    # The library says the same, in its own argument names.
    with KVStoreClient(secure.address, token=TOKEN, timeout=5) as client:
        with pytest.raises(ConnectionError, match=r"speaks TLS: pass tls_ca$"):
            client.check()


def test_the_client_takes_its_token_from_the_environment_or_a_file(daemon_factory, short_tmp, monkeypatch):
    """Before: KVStoreClient ignored KVSTORE_AUTH_TOKEN and had no token_file."""
    daemon = daemon_factory("plain", listen=f"127.0.0.1:{free_port()}", auth_token=TOKEN)
    keys, payloads = make_blocks(1, seed=72)
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN", TOKEN)
    with KVStoreClient(daemon.address) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])
    monkeypatch.delenv("KVSTORE_AUTH_TOKEN")
    book = secret_file(short_tmp / "tokens", f"{daemon.address} {TOKEN}\n127.0.0.1:1 {OTHER_TOKEN}\n")
    with KVStoreClient(daemon.address, token_file=book) as client:
        assert client.lookup(keys).hits == 1
    with KVStoreClient(daemon.address, timeout=5) as client:
        with pytest.raises(ConnectionError, match="refused the bearer token"):
            client.check()


def test_stats_clear_and_ingest_without_a_daemon_say_so_in_one_line(short_tmp):
    """Before: a raw gRPC error; ingest loaded the model first (here a model file that does not
    exist: the daemon is checked before it is looked for)."""
    unix = f"unix:{short_tmp / 'none.sock'}"
    tcp = f"127.0.0.1:{free_port()}"
    for address in (unix, tcp):
        for command in ("stats", "clear"):
            assert one_line(kvstore(command, "--address", address, env={"KVSTORE_AUTH_TOKEN": TOKEN})) == \
                f"kvstore: no daemon at {address} (is `kvstore serve` running?)"
    document = short_tmp / "doc.txt"
    document.write_text("A document. " * 100)
    started = time.monotonic()
    assert one_line(kvstore("ingest", document, "--address", unix, "--model", short_tmp / "absent.gguf")) == \
        f"kvstore: no daemon at {unix} (is `kvstore serve` running?)"
    assert time.monotonic() - started < 60


def test_no_token_goes_in_plaintext_to_a_host_that_is_not_loopback(short_tmp):
    """Refused in one line before anything is sent, unless --insecure. Before: locate sent its
    one token in plaintext to every host, and the client to any address."""
    token_file = secret_file(short_tmp / "token", TOKEN)
    ids = short_tmp / "ids.json"
    ids.write_text(json.dumps(list(range(300))))
    refusal = (f"kvstore: refusing to send a bearer token in plaintext to {REMOTE} (not a loopback address): "
               f"give --tls-ca (or KVSTORE_TLS_CA) for TLS, or --insecure on a network you trust")
    started = time.monotonic()
    assert one_line(kvstore("locate", "--hosts", f"127.0.0.1:{free_port()},{REMOTE}", "--token-file", token_file,
                            "--tokens", ids)) == refusal
    assert one_line(kvstore("stats", "--address", REMOTE, env={"KVSTORE_AUTH_TOKEN": TOKEN})) == refusal
    assert time.monotonic() - started < 60  # nothing waited on the unreachable host
    # The library: refused, unless insecure or over TLS; no token, nothing to refuse.
    keys = [bytes(16)]
    with pytest.raises(ValueError, match=f"refusing to send a bearer token in plaintext to {REMOTE}"):
        locate([REMOTE], keys, token=TOKEN)
    with pytest.raises(ValueError, match="refusing to send a bearer token in plaintext"):
        KVStoreClient(REMOTE, token=TOKEN)
    assert not locate([REMOTE], keys, deadline_s=0.2, token=TOKEN, insecure=True).hosts[0].answered
    assert not locate([REMOTE], keys, deadline_s=0.2).hosts[0].answered
    KVStoreClient(REMOTE, token=TOKEN, insecure=True).close()


def test_locate_with_per_host_tokens_and_tls(daemon_factory, certificate, short_tmp):
    """Two TLS daemons with different tokens and a unix-socket daemon without one: each gets its
    own token over TLS (the unix socket in plaintext), from a file of lines or of TOML. Before:
    one token for every host, in plaintext."""
    from engine_adapter.cached import config_namespace
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config

    try:
        config, _ = gguf_config(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    cert, _ = certificate
    namespace = config_namespace(config, "float32")
    tokens = np.random.default_rng(6).integers(0, 40000, size=3 * namespace.chunk_tokens + 5).tolist()
    keys = prefix_keys(namespace, tokens)
    payload = np.zeros(namespace.layout.block_bytes(namespace.chunk_tokens), np.uint8)  # 11.8 MB
    a = tls_daemon(daemon_factory, certificate, "a", TOKEN)
    b = tls_daemon(daemon_factory, certificate, "b", OTHER_TOKEN)
    local = daemon_factory("local")
    for daemon, token, held in ((a, TOKEN, 3), (b, OTHER_TOKEN, 1), (local, None, 2)):
        with KVStoreClient(daemon.address, token=token, tls_ca=str(cert)) as client:
            client.put(namespace, [(k, namespace.chunk_tokens, payload) for k in keys[:held]])
    ids = short_tmp / "ids.json"
    ids.write_text(json.dumps(tokens))
    hosts = f"{a.address},{b.address},{local.address}"

    lines = secret_file(short_tmp / "tokens", f"# per daemon\n{a.address} {TOKEN}\n{b.address} {OTHER_TOKEN}\n")
    out = kvstore("locate", "--hosts", hosts, "--tokens", ids, "--token-file", lines, "--tls-ca", cert, "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert [(h["hits"], h["error"]) for h in answer["hosts"]] == [(3, ""), (1, ""), (2, "")]
    assert answer["best"] == a.address

    # TOML, b not listed and no default: b refuses, the others answer.
    toml = secret_file(short_tmp / "tokens.toml", f'[hosts."{a.address}"]\ntoken = "{TOKEN}"\n')
    out = kvstore("locate", "--hosts", hosts, "--tokens", ids, "--token-file", toml, "--json",
                  env={"KVSTORE_TLS_CA": str(cert)})
    assert out.returncode == 0, out.stderr
    got = {h["address"]: (h["hits"], h["error"]) for h in json.loads(out.stdout)["hosts"]}
    assert got[a.address] == (3, "") and got[local.address] == (2, "")
    assert got[b.address][1] == (f"UNAUTHENTICATED: {b.address} refused the bearer token (none was given): pass "
                                 f"the daemon's token with --token-file FILE or KVSTORE_AUTH_TOKEN")

    # Without the CA: the TLS hosts are named as such, not 'Socket closed'.
    out = kvstore("locate", "--hosts", hosts, "--tokens", ids, "--token-file", lines, "--json")
    assert out.returncode == 0, out.stderr
    got = {h["address"]: h["error"] for h in json.loads(out.stdout)["hosts"]}
    assert got[a.address] == f"UNAVAILABLE: {a.address} speaks TLS: pass --tls-ca (or KVSTORE_TLS_CA)"


def test_token_files_one_token_lines_or_toml(short_tmp):
    one = secret_file(short_tmp / "one", f"  {TOKEN}\n")
    assert TokenBook.read(one) == TokenBook(TOKEN, {})
    lines = secret_file(short_tmp / "lines", f"# comment\n10.0.0.5:7070 {TOKEN}\n{OTHER_TOKEN}  # the rest\n")
    book = TokenBook.read(lines)
    assert book.for_address("10.0.0.5:7070") == TOKEN and book.for_address("10.0.0.6:7070") == OTHER_TOKEN
    toml = secret_file(short_tmp / "t.toml", f'token = "{OTHER_TOKEN}"\n[hosts."10.0.0.5:7070"]\ntoken = "{TOKEN}"\n')
    assert TokenBook.read(toml) == book
    for text, error in (("", "holds no token"), ("a b c\n", "line 1: expected 'ADDRESS TOKEN'"),
                        ("x\ny\n", "line 2: a second token"), ("h:1 x\nh:1 y\n", "h:1 is listed twice"),
                        ('[hosts."h:1"]\ntoken = 3\n', "needs token"), ('token = "x"\nport = 3\n', "unknown keys")):
        with pytest.raises(ValueError, match=error):
            TokenBook.read(secret_file(short_tmp / "bad", text))
    with pytest.raises(ValueError, match="cannot read the token file"):
        TokenBook.read(short_tmp / "absent")


def test_the_vllm_connector_takes_tls_and_token_file_keys():
    from engine_adapter.vllm.settings import ConnectorSettings  # no vLLM needed

    settings = ConnectorSettings.from_extra_config(
        {"address": "10.0.0.5:7070", "tls_ca": "/etc/kvstore/ca.pem", "tls_cert": "c.pem", "tls_key": "k.pem",
         "tls_server_name": "kvstore", "token_file": "/run/secrets/kvstore", "insecure": "false"})
    assert (settings.tls_ca, settings.token_file, settings.insecure) == ("/etc/kvstore/ca.pem", "/run/secrets/kvstore",
                                                                        False)


def test_every_client_resolves_flags_then_environment_then_the_daemons_config_file(daemon_factory, certificate,
                                                                                   short_tmp, monkeypatch):
    """Issue #57: `kvstore stats` ignored KVSTORE_LISTEN and the config file, KVStoreClient ignored
    KVSTORE_TLS_CA. Now the CLI, KVStoreClient and locate take the address, token, CA and server
    name from flags, else KVSTORE_*, else the file `kvstore serve --config` reads (its listen and
    auth_token, and a [client] table the daemon skips); the daemon starts from that same file."""
    cert, key = certificate
    port = free_port()
    config = secret_file(short_tmp / "kvstore.toml",
                         f'listen = "0.0.0.0:{port}"\nauth_token = "{TOKEN}"\ntls_cert = "{cert}"\n'
                         f'tls_key = "{key}"\nallow_anonymous_loopback = false\n'
                         f'[client]\ntls_ca = "{cert}"\ntls_server_name = "localhost"\n')
    daemon = daemon_factory("configured", config=config, listen=f"0.0.0.0:{port}")
    keys, payloads = make_blocks(1, seed=573)
    # The file alone: 0.0.0.0 is reached on loopback, the token and CA come from it.
    out = kvstore("stats", "--json", env={"KVSTORE_CONFIG": str(config)})
    assert out.returncode == 0, out.stderr
    with KVStoreClient(config_file=config) as client:
        assert client.address == f"127.0.0.1:{port}" and client.tls.server_name == "localhost"
        client.put(NS, [(keys[0], 64, payloads[0])])
    # The environment wins over the file, a flag over the environment.
    monkeypatch.setenv("KVSTORE_CONFIG", str(config))
    monkeypatch.setenv("KVSTORE_LISTEN", "127.0.0.1:1")
    with pytest.raises(Exception, match="no daemon at 127.0.0.1:1"):
        with KVStoreClient(timeout=5) as client:
            client.lookup(keys)
    with KVStoreClient(f"127.0.0.1:{port}") as client:
        assert client.lookup(keys).hits == 1
    monkeypatch.delenv("KVSTORE_LISTEN")
    monkeypatch.setenv("KVSTORE_TLS_SERVER_NAME", "kvstore.example")
    assert one_line(kvstore("stats", env={"KVSTORE_CONFIG": str(config), "KVSTORE_TLS_SERVER_NAME": "kvstore.example"})) \
        .startswith(f"kvstore: 127.0.0.1:{port}: its TLS certificate is not for kvstore.example (")
    monkeypatch.delenv("KVSTORE_TLS_SERVER_NAME")
    result = locate([f"127.0.0.1:{port}"], keys, **_located(config))
    assert result.best is not None and result.best.hits == 1
    # A [client] table with a key clients do not take is one line naming the file.
    bad = secret_file(short_tmp / "bad.toml", f'listen = "127.0.0.1:{port}"\n[client]\nca = "x"\n')
    assert one_line(kvstore("stats", "--config", bad)).startswith(f"kvstore: config file {bad}: [client] takes only")


def _located(config) -> dict:
    """`locate`'s token and TLS as the CLI resolves them from ``config``."""
    from kvstore.connect import client_settings

    settings = client_settings(config_file=config, environ={})
    return {"token": settings.token, "tls": settings.tls}


def test_the_python_client_fails_in_one_line_not_a_grpc_traceback(daemon_factory, certificate, monkeypatch):
    """Issue #57: a KVStoreClient call that cannot reach the daemon raised gRPC's multi-line
    _InactiveRpcError; now a DaemonError (still a grpc.RpcError, same code) whose text is the CLI's
    one line in the library's own names, and KVSTORE_TLS_CA is taken."""
    import grpc

    from kvstore.connect import DaemonError

    cert, _ = certificate
    secure = tls_daemon(daemon_factory, certificate)
    keys, _ = make_blocks(1, seed=574)
    with KVStoreClient(secure.address, token=TOKEN, timeout=5) as client:
        with pytest.raises(DaemonError) as failed:
            client.lookup(keys)
    assert str(failed.value) == f"{secure.address} speaks TLS: pass tls_ca"
    assert isinstance(failed.value, grpc.RpcError) and failed.value.code() == grpc.StatusCode.UNAVAILABLE
    monkeypatch.setenv("KVSTORE_TLS_CA", str(cert))
    with KVStoreClient(secure.address, token=TOKEN, timeout=5) as client:
        assert client.lookup(keys).hits == 0
    with KVStoreClient(secure.address, token="wrong-token-0123456789", timeout=5) as client:
        with pytest.raises(DaemonError, match=r"^127\.0\.0\.1:\d+ refused the bearer token: pass the daemon's token"):
            client.lookup(keys)


def test_locate_hints_at_another_dtype_to_the_tenant_that_stored_it_only(daemon_factory, short_tmp):
    """Issue #57: `locate --dtype bfloat16` after a float32 ingest said `0/3 chunks ... best: none`,
    as for an empty cache. Now it adds a hint naming the dtype the first chunk is held under; the
    hint asks with the caller's own token, so another tenant (whose keys derive from its token)
    gets none."""
    from engine_adapter.cached import config_namespace
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
    from tests.test_tenancy import TOKEN_A, TOKEN_B, _tenants

    try:
        config, _ = gguf_config(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    namespace = config_namespace(config, "float32")
    tokens = np.random.default_rng(57).integers(0, 40000, size=3 * namespace.chunk_tokens).tolist()
    payload = np.zeros(namespace.layout.block_bytes(namespace.chunk_tokens), np.uint8)
    daemon = daemon_factory(tenants_file=_tenants(short_tmp), log_level="INFO")
    assert "no admin token (kvstore clear and daemon-wide stats need --admin-token-file)" in daemon.log.read_text()
    with KVStoreClient(daemon.address, token=TOKEN_A) as client:
        client.put(namespace, [(k, namespace.chunk_tokens, payload) for k in prefix_keys(namespace, tokens)])
    ids = short_tmp / "ids.json"
    ids.write_text(json.dumps(tokens))

    def located(token: str, dtype: str) -> dict:
        out = kvstore("locate", "--hosts", daemon.address, "--tokens", ids, "--dtype", dtype, "--json",
                      env={"KVSTORE_AUTH_TOKEN": token})
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    mine = located(TOKEN_A, "bfloat16")
    assert mine["best"] is None and mine["hint"].startswith("the first chunk is cached under --dtype float32, not "
                                                            "bfloat16")
    assert located(TOKEN_A, "float32")["hint"] is None, "a hit needs no hint"
    theirs = located(TOKEN_B, "bfloat16")
    assert theirs["best"] is None and theirs["hint"] is None, "tenant b learns nothing of a's blocks"
    text = kvstore("locate", "--hosts", daemon.address, "--tokens", ids, "--dtype", "bfloat16",
                   env={"KVSTORE_AUTH_TOKEN": TOKEN_A}).stdout
    assert "best: none" in text and "hint: the first chunk is cached under --dtype float32" in text


def test_a_client_pointed_at_the_metrics_port_says_so_in_one_line(daemon_factory):
    """Issue #57: `kvstore stats --address` the metrics port printed gRPC's raw HTTP/2 parse error."""
    port = free_port()
    daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    assert one_line(kvstore("stats", "--address", f"127.0.0.1:{port}")) == \
        (f"kvstore: 127.0.0.1:{port} answers HTTP/1.1, not gRPC: it is the daemon's metrics port (metrics_listen: "
         f"/metrics, /healthz, /readyz); give the address the daemon listens on (listen)")


def test_a_client_dropped_without_close_is_freed_at_once(daemon):
    """Issue #58's review: the arena's calls held the client (a reference cycle), so a client
    dropped without ``close`` kept its arena, its lease socket (one of the daemon's per-client
    arenas) and its channel until the cycle collector ran. They hold it weakly now."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        client = KVStoreClient(daemon.address)
        assert client.shared_memory
        with client.fetch([b"\x01" * 16], 4096) as blocks:  # a call through the arena works
            assert blocks == [None]
        gone = weakref.ref(client)
        del client, blocks
        assert gone() is None
    finally:
        gc.enable()
