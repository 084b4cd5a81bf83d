"""The CLI's commands that call a running daemon: ``kvstore stats``, ``clear``, ``ingest``, ``locate``.

Each reaches its daemons as ``kvstore.connect.client_settings`` says (flags, else the KVSTORE_*
environment, else the daemon's config file: address, token, TLS); stats, clear and ingest
ask theirs once before any work. A failure rises for ``kvstore.cli.main`` to say in one line.
Their flags are ``kvstore/cli.py``'s (``_connection_arguments``, ``_namespace_arguments``); grpc,
the client and the model are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from kvstore.user_input import format_size, read_text


def _settings(args: argparse.Namespace, admin: bool = False):
    """``args``' flags, else the KVSTORE_* environment, else the config file (kvstore.connect.client_settings)."""
    from kvstore.connect import CLI_OPTIONS, client_settings

    return client_settings(getattr(args, "address", None), args.token, args.token_file, args.tls_ca,
                           args.tls_cert, args.tls_key, args.tls_server_name, args.insecure, config_file=args.config,
                           admin=admin, names=CLI_OPTIONS)


def _client(args: argparse.Namespace, shared_memory: bool | None = False, check: bool = True):
    """A client of ``args``' daemon; with ``check``, the daemon is asked once first, and a problem
    (no daemon, TLS or not, the token) is a one-line error before any work."""
    from engine_adapter.client.kvstore_client import KVStoreClient
    from kvstore.connect import CLI_OPTIONS
    from kvstore.locate import refuse_plaintext_tokens

    settings = _settings(args, admin=args.command in ("stats", "clear"))
    refuse_plaintext_tokens({settings.address: settings.token}, settings.tls, settings.insecure, CLI_OPTIONS)
    client = KVStoreClient(settings=settings, shared_memory=shared_memory)
    if check:
        try:
            client.check(names=CLI_OPTIONS)
        except BaseException:
            client.close()
            raise
    return client


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"{'tier':<6} {'blocks':>8} {'used':>12} {'capacity':>12} {'hits':>8} {'evictions':>9} "
          f"{'promoted':>8} {'demoted':>8} {'corrupt':>7}")
    for name, t in stats["tiers"].items():
        capacity = format_size(t["capacity_bytes"]) if t["capacity_bytes"] else "unbounded"
        print(f"{name:<6} {t['blocks']:>8} {format_size(t['used_bytes']):>12} {capacity:>12} "
              f"{t['hits']:>8} {t['evictions']:>9} {t['promotions_in']:>8} {t['demotions_in']:>8} {t['corrupt']:>7}")
    print(f"misses {stats['misses']}  pinned {stats['pinned']}  queue {stats['queue_depth']} "
          f"(dropped {stats['queue_dropped']})  arenas {stats['arenas']}  write errors {stats['write_errors']}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0, printing ``SERVING``, when the daemon's gRPC health check (no token needed) answers
    SERVING within ``--timeout``; else 1 and one line why. An exec probe over the daemon's own
    address (by default its 0600 unix socket): a local user flooding the metrics port cannot reach
    it, and a wedged event loop fails it (the check is answered there)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.connect import CLI_OPTIONS, explain, open_channel

    settings = _settings(args)
    with open_channel(settings.address, settings.tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=args.timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"{settings.address} did not answer within {args.timeout:g} s"
            else:
                why = explain(exc, settings.address, settings.tls, None, names=CLI_OPTIONS) or \
                    f"{settings.address}: {exc.code().name}: {exc.details()}"
            print(f"kvstore: not healthy: {why}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"kvstore: not healthy: {settings.address} says {status}", file=sys.stderr)
        return 1
    print(status)
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    with _client(args) as client:
        count = client.clear(args.tier or [])
    print(f"cleared {count} blocks")
    return 0


def context_overflow(tokens: int, max_context: int) -> int:
    """Tokens of a ``tokens``-token document prompt beyond the model's context of ``max_context``
    (0 when it fits or the context is unknown): chunks there could never be part of a prompt."""
    return max(0, tokens - max_context) if max_context > 0 else 0


class _Kept:
    """What `kvstore ingest` has stored so far, per file, to say what an interrupted run kept."""

    def __init__(self) -> None:
        self.files: list[list] = []  # [path, chunks stored now, chunks already cached (None: not yet known), of]

    def begin(self, path: str, chunks: int) -> None:
        self.files.append([path, 0, None, chunks])

    def progress(self, n: int) -> None:
        """`CachedEngine.ingest`'s progress: first the chunks already cached, then 1 per chunk stored."""
        entry = self.files[-1]
        if entry[2] is None:
            entry[2] = n
        else:
            entry[1] += n

    def done(self, stored: int, present: int) -> None:
        self.files[-1][1:3] = [stored, present]

    def summary(self) -> str:
        stored = sum(f[1] for f in self.files)
        if not self.files or not stored and not any(f[2] for f in self.files):
            return "interrupted before any chunk was stored"
        each = ", ".join(f"{os.path.basename(str(path))} {new + (old or 0)} of {total}"
                         for path, new, old, total in self.files)
        return (f"interrupted: {stored} chunks stored by this run stay in the daemon (cached now: {each}); run the "
                f"same ingest again for the rest (cached chunks are skipped)")


def cmd_ingest(args: argparse.Namespace) -> int:
    """Precompute the KV of documents (in the document-QA prompt layout) and store it. Chunks
    beyond the model's context are not stored (a warning says how many tokens were beyond); Ctrl-C
    says what was stored and exits 130."""
    kept = _Kept()
    try:
        return _ingest(args, kept)
    except KeyboardInterrupt:
        print(f"kvstore: {kept.summary()}", file=sys.stderr, flush=True)
        return 130


def _ingest(args: argparse.Namespace, kept: _Kept) -> int:
    import torch
    from tqdm import tqdm

    from engine_adapter.cached import CachedEngine
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
    from engine_adapter.reference.prompts import document_prompt

    texts = {path: read_text(path) for path in args.files}  # every file, before the model loads
    _client(args).close()  # the daemon, the token and TLS are checked before the model loads
    model, tokenizer = load_gguf(args.model or find_smollm2_gguf(), dtype=getattr(torch, args.dtype))
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    with _client(args, shared_memory=None, check=False) as client:
        engine = CachedEngine(model, tokenizer, client, tenant=args.tenant)
        for path, text in texts.items():
            context_ids, _ = document_prompt(tokenizer, text, "")
            chunk_tokens = engine.namespace.chunk_tokens
            total = len(context_ids)
            beyond = context_overflow(total, max_context)
            if beyond:
                # A prompt holds at most max_context tokens, one of them after the reused chunks.
                usable = (max_context - 1) // chunk_tokens
                print(f"kvstore: warning: {path}: {len(context_ids)} tokens with the prompt, {beyond} beyond the "
                      f"model's context of {max_context} tokens: only its first {usable} chunks "
                      f"({usable * chunk_tokens} tokens) are stored; no prompt can use chunks past the context",
                      file=sys.stderr, flush=True)
                context_ids = context_ids[: usable * chunk_tokens]
            chunks = len(context_ids) // chunk_tokens
            if chunks == 0:
                print(f"{path}: {len(context_ids)} tokens with the prompt, shorter than one chunk "
                      f"({chunk_tokens} tokens): nothing stored (only full chunks are cached)")
                continue
            kept.begin(path, chunks)

            def progress(n: int, bar) -> None:
                kept.progress(n)
                bar.update(n)

            with tqdm(total=chunks, desc=os.path.basename(path), unit="chunk") as bar:
                stored, present = engine.ingest(context_ids, progress=lambda n: progress(n, bar))
            kept.done(stored, present)
            print(f"{path}: {total} tokens, {stored} chunks stored, {present} already cached"
                  + (f" ({beyond} tokens beyond the context not stored)" if beyond else ""))
    return 0


def cmd_locate(args: argparse.Namespace) -> int:
    """Which daemon holds the longest cached prefix of a document (or of token ids). When no host
    holds its first chunk, the same chunk under each other dtype is asked for too, with the same
    token: a tenant sees a hint about its own blocks only (keys derive from its token)."""
    from engine_adapter.cached import config_namespace
    from engine_adapter.reference.loader import find_smollm2_gguf, gguf_config
    from engine_adapter.reference.prompts import document_prompt
    from kvstore.keys import SUPPORTED_DTYPES, prefix_keys
    from kvstore.connect import CLI_OPTIONS, TokenBook
    from kvstore.locate import locate, refuse_plaintext_tokens, tokens_for

    settings = _settings(args)  # the environment's and config file's address, token and TLS
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else [settings.address]
    if not hosts:
        raise ValueError("--hosts: give daemon addresses, e.g. 10.0.0.5:7070,10.0.0.6:7070")
    book = TokenBook.read(args.token_file) if args.token_file else None
    token = args.token or (settings.token if book is None else None)
    tls = settings.tls
    refuse_plaintext_tokens(tokens_for(hosts, token, book), tls, settings.insecure, CLI_OPTIONS)  # before any work
    text = read_text(args.file)
    config, tokenizer = gguf_config(args.model or find_smollm2_gguf())
    if args.tokens:
        try:
            token_ids = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{args.file}: not JSON: {exc}") from None
        if not isinstance(token_ids, list) or not all(isinstance(t, int) and t >= 0 for t in token_ids):
            raise ValueError(f"{args.file}: --tokens needs a JSON list of token ids (non-negative integers)")
    else:
        token_ids, _ = document_prompt(tokenizer, text, "")  # as `kvstore ingest` stores it
    namespace = config_namespace(config, args.dtype, args.tenant)
    keys = prefix_keys(namespace, token_ids)
    ask = dict(deadline_s=args.deadline, token=token, tokens=book, tls=tls, insecure=settings.insecure,
               names=CLI_OPTIONS)
    result = locate(hosts, keys, **ask)
    hint = None
    if keys and result.best is None:  # a miss of everything: held under another dtype? (the caller's keys only)
        for dtype in SUPPORTED_DTYPES:
            if dtype != args.dtype and locate(hosts, prefix_keys(config_namespace(config, dtype, args.tenant),
                                                                 token_ids)[:1], **ask).best is not None:
                hint = (f"the first chunk is cached under --dtype {dtype}, not {args.dtype}: "
                        f"locate with the dtype ingest (or the engine) stored")
                break
    if args.json:
        print(json.dumps({"keys": result.keys, "chunk_tokens": namespace.chunk_tokens,
                          "best": result.best.address if result.best else None,
                          "hosts": [dataclasses.asdict(h) for h in result.hosts], "hint": hint}, indent=2))
        return 0
    print(f"{len(token_ids)} tokens, {result.keys} full chunks of {namespace.chunk_tokens} tokens")
    for host in result.hosts:
        if host.answered:
            tiers = " ".join(f"{t} x{host.tiers.count(t)}" for t in dict.fromkeys(host.tiers)) or "-"
            print(f"{host.address:<32} {host.hits:>4}/{result.keys} chunks  {tiers}  ({host.seconds * 1000:.1f} ms)")
        else:
            print(f"{host.address:<32} unreachable: {host.error}")
    print(f"best: {result.best.address}" if result.best else "best: none (no host holds the first chunk)")
    if hint:
        print(f"hint: {hint}")
    return 0
