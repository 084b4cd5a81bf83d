"""The data channel (kvstore/daemon/data_channel.py): remote clients' payloads as raw bytes beside gRPC.
Real daemons; the client, and raw sockets for what a hostile peer sends."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.keys import KVLayout, Namespace, prefix_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import (ERROR, FRAME_HEAD, GET, GET_REPLY, HELLO, PUT, PUT_REPLY, READY, frame, layout_message,
                          parse_error)
from tests.conftest import free_port
from tests.test_security import _self_signed

TOKEN = "data-token-0123456789"
TOKEN_A, TOKEN_B = "tenant-a-token-0123456789", "tenant-b-token-0123456789"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=40, dtype="float16")
NS = Namespace("data-channel", LAYOUT, chunk_tokens=64)
TOKENS = (63, 30, 64, 17, 50)  # irregular blocks: LAYOUT.block_bytes(t) = 480 * t bytes


def blocks(seed: int) -> tuple[list[bytes], list[tuple[bytes, int, np.ndarray]]]:
    """Keys and (key, tokens, payload) blocks of irregular sizes, random bytes that are never zero."""
    rng = np.random.default_rng(seed)
    keys = prefix_keys(NS, rng.integers(0, 49152, size=len(TOKENS) * NS.chunk_tokens))
    return keys, [(k, t, rng.integers(1, 256, LAYOUT.block_bytes(t), dtype=np.uint8)) for k, t in zip(keys, TOKENS)]


def serve(daemon_factory, name="d0", **settings):
    settings = {"listen": f"127.0.0.1:{free_port()}", "data_listen": "127.0.0.1:0", **settings}
    if "tenants_file" not in settings:
        settings.setdefault("auth_token", TOKEN)
    return daemon_factory(name, **settings)


def data_port(daemon, token=TOKEN, **tls) -> int:
    with KVStoreClient(daemon.address, token=token, **tls) as client:
        return client.stats()["data_port"]


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next frame, or None at EOF (a closed connection)."""
    head = b""
    while len(head) < FRAME_HEAD.size:
        got = sock.recv(FRAME_HEAD.size - len(head))
        if not got:
            return None
        head += got
    kind, length = FRAME_HEAD.unpack(head)
    body = b""
    while len(body) < length:
        got = sock.recv(length - len(body))
        assert got, "closed mid-frame"
        body += got
    return kind, body


def closed(sock: socket.socket) -> bool:
    try:
        return read_frame(sock) is None
    except ConnectionResetError:
        return True


def expect_error(sock: socket.socket, code: grpc.StatusCode) -> str:
    found = read_frame(sock)
    assert found is not None and found[0] == ERROR, found
    got, message = parse_error(found[1])
    assert got == code.value[0], (got, message)
    assert message and "\n" not in message
    return message


def hello(port: int, token: str | None = TOKEN) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(frame(HELLO, (token or "").encode()))
    if token == TOKEN:
        assert read_frame(sock) == (READY, b"")
    return sock


def put_message(key: bytes, tokens: int) -> bytes:
    meta = pb.BlockMeta(key=key, namespace=NS.id, layout=layout_message(LAYOUT), tokens=tokens,
                        payload_len=LAYOUT.block_bytes(tokens))
    return frame(PUT, pb.PutRequest(items=[pb.PutItem(meta=meta)]).SerializeToString())


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def assert_round_trip(address: str, seed: int, **client) -> None:
    keys, stored = blocks(seed)
    with KVStoreClient(address, shared_memory=False, **client) as c:
        assert c.data_channel
        assert c.put(NS, stored) == len(stored)
        with c.fetch(keys, LAYOUT.block_bytes(64)) as fetched:
            for (_, tokens, payload), got in zip(stored, fetched):
                assert got.tokens == tokens and got.tier == "cpu"
                assert bytes(got.payload) == payload.tobytes()
        assert c.get(keys[::-1], LAYOUT.block_bytes(64)) == [p.tobytes() for _, _, p in stored[::-1]]


def test_put_and_get_round_trip_through_the_data_channel(daemon_factory):
    d = serve(daemon_factory)
    assert_round_trip(d.address, seed=1, token=TOKEN)
    with KVStoreClient(d.address, token=TOKEN) as c:
        stats = c.stats()
        assert stats["inline_bytes"] == 0 and stats["data_port"] > 0
        keys, _ = blocks(1)
        with c.fetch(keys + [b"\x07" * 16], LAYOUT.block_bytes(64)) as fetched:  # a miss among hits
            assert fetched[-1] is None and all(b is not None for b in fetched[:-1])


def test_a_daemon_without_a_data_channel_keeps_inline_grpc(daemon_factory):
    d = daemon_factory(listen=f"127.0.0.1:{free_port()}", auth_token=TOKEN)
    keys, stored = blocks(2)
    with KVStoreClient(d.address, token=TOKEN) as c:
        assert not c.data_channel
        c.put(NS, stored)
        assert c.get(keys, LAYOUT.block_bytes(64)) == [p.tobytes() for _, _, p in stored]


def test_tokens_tenants_and_refusals_before_any_payload(daemon_factory, short_tmp):
    tenants = short_tmp / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "a"\ntoken = "{TOKEN_A}"\n\n[[tenant]]\nname = "b"\ntoken = "{TOKEN_B}"\n')
    tenants.chmod(0o600)
    d = serve(daemon_factory, tenants_file=str(tenants))
    keys, stored = blocks(3)
    with KVStoreClient(d.address, token=TOKEN_A) as a, KVStoreClient(d.address, token=TOKEN_B) as b:
        assert a.data_channel and b.data_channel
        a.put(NS, stored)
        with b.fetch(keys, LAYOUT.block_bytes(64)) as seen_by_b:
            assert seen_by_b == [None] * len(keys)  # B names only its own stored keys
        assert a.get(keys, LAYOUT.block_bytes(64)) == [p.tobytes() for _, _, p in stored]
        port = a.stats()["data_port"]
    for token in ("wrong-token-0123456789", None):
        sock = hello(port, token)
        expect_error(sock, grpc.StatusCode.UNAUTHENTICATED)
        assert closed(sock)
        sock.close()
    # a PUT without HELLO: refused on its head, before its payload is read, and closed
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(put_message(keys[0], 64))
    expect_error(sock, grpc.StatusCode.UNAUTHENTICATED)
    assert closed(sock)
    sock.close()
    with pytest.raises(grpc.RpcError) as refused:  # the client's way: a wrong token is the gRPC call's error
        KVStoreClient(d.address, token="wrong-token-0123456789").put(NS, stored)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_with_the_daemons_certificate(daemon_factory, short_tmp):
    cert, key = _self_signed(short_tmp)
    d = serve(daemon_factory, tls_cert=cert, tls_key=key)
    assert_round_trip(d.address, seed=4, token=TOKEN, tls_ca=str(cert))
    port = data_port(d, tls_ca=str(cert))
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)  # plaintext to a TLS port: no answer
    sock.sendall(frame(HELLO, TOKEN.encode()))
    found = read_frame(sock) if not closed(sock) else None
    assert found is None or found[0] not in (READY, ERROR)
    sock.close()


@pytest.mark.parametrize("attack", ["oversized", "unknown kind", "garbage", "truncated", "not a message"])
def test_bad_input_gets_one_line_and_a_closed_connection(daemon_factory, attack):
    d = serve(daemon_factory)
    port = data_port(d)
    sock = hello(port)
    if attack == "oversized":
        sock.sendall(struct.pack("!BI", PUT, 2**32 - 1))
        assert "at most" in expect_error(sock, grpc.StatusCode.INVALID_ARGUMENT)
    elif attack == "unknown kind":
        sock.sendall(frame(9, b"x"))
        assert "unknown frame kind 9" in expect_error(sock, grpc.StatusCode.INVALID_ARGUMENT)
    elif attack == "garbage":
        sock.sendall(bytes(np.random.default_rng(5).integers(16, 256, 64, dtype=np.uint8)))
        expect_error(sock, grpc.StatusCode.INVALID_ARGUMENT)
    elif attack == "not a message":
        sock.sendall(frame(GET, b"\xff" * 40))
        expect_error(sock, grpc.StatusCode.INVALID_ARGUMENT)
    else:  # a frame cut short, then the client goes away
        sock.sendall(struct.pack("!BI", GET, 100) + b"\x0a" * 10)
        sock.shutdown(socket.SHUT_WR)
    assert closed(sock)
    sock.close()
    assert_round_trip(d.address, seed=6, token=TOKEN)  # the daemon serves the others


def test_refused_requests_keep_the_connection_when_in_step(daemon_factory):
    d = serve(daemon_factory)
    sock = hello(data_port(d))
    keys, _ = blocks(7)
    sock.sendall(frame(GET, pb.GetRequest(items=[pb.GetItem(key=keys[0])]).SerializeToString()))
    assert "not stored" in expect_error(sock, grpc.StatusCode.NOT_FOUND)  # strict Get of a missing key
    bad = pb.PutRequest(items=[pb.PutItem(meta=pb.BlockMeta(key=b"short", payload_len=8))])
    sock.sendall(frame(PUT, bad.SerializeToString()) + b"\x01" * 8)
    expect_error(sock, grpc.StatusCode.INVALID_ARGUMENT)
    sock.sendall(frame(GET, pb.GetRequest(items=[pb.GetItem(key=keys[0])], allow_missing=True).SerializeToString()))
    kind, body = read_frame(sock)
    assert kind == GET_REPLY and not pb.GetResponse.FromString(body).results[0].found
    sock.close()


def test_a_client_gone_mid_transfer_leaves_no_block_and_no_bytes_held(daemon_factory):
    d = serve(daemon_factory)
    keys, stored = blocks(8)
    with KVStoreClient(d.address, token=TOKEN) as c:
        port = c.stats()["data_port"]
        # Put: the message and half its payload, then the connection closes
        sock = hello(port)
        sock.sendall(put_message(keys[0], 64) + b"\x05" * (LAYOUT.block_bytes(64) // 2))
        wait_for(lambda: c.stats()["inline_bytes"] > 0)  # the daemon holds the payload's buffer...
        sock.close()
        wait_for(lambda: c.stats()["inline_bytes"] == 0)  # ...until the connection ends
        assert c.lookup(keys[:1]).hits == 0  # no partial block
        # Get: a reply larger than the socket buffers, read only to its head, then closed
        big = [(k, 64, np.random.default_rng(i).integers(1, 256, LAYOUT.block_bytes(64), dtype=np.uint8))
               for i, k in enumerate(prefix_keys(NS, np.arange(64 * 400)))]
        c.put(NS, big)
        sock = hello(port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(frame(GET, pb.GetRequest(items=[pb.GetItem(key=k) for k, _, _ in big]).SerializeToString()))
        kind, _ = read_frame(sock)
        assert kind == GET_REPLY
        sock.close()
        wait_for(lambda: c.stats()["inline_bytes"] == 0)
        assert c.lookup(keys[:1]).hits == 0
    assert_round_trip(d.address, seed=9, token=TOKEN)


def test_connection_cap(daemon_factory):
    d = serve(daemon_factory, data_max_connections=2)
    port = data_port(d)
    held = [hello(port), hello(port)]
    extra = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert "data_max_connections" in expect_error(extra, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert closed(extra)
    extra.close()
    held.pop().close()
    time.sleep(0.3)  # the daemon sees the close
    again = hello(port)
    again.sendall(frame(GET, pb.GetRequest(allow_missing=True).SerializeToString()))
    assert read_frame(again)[0] == GET_REPLY
    for sock in held + [again]:
        sock.close()


def test_no_tenant_and_no_stranger_holds_the_slots_others_need(daemon_factory, short_tmp):
    """Of 8 connections, a tenant holds at most 2, and peers that send no token at most 4 at once:
    a fifth closes the one that waited longest, so a tenant that sends its token at once gets in."""
    tenants = short_tmp / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "a"\ntoken = "{TOKEN_A}"\n\n[[tenant]]\nname = "b"\ntoken = "{TOKEN_B}"\n')
    tenants.chmod(0o600)
    d = serve(daemon_factory, tenants_file=str(tenants), data_max_connections=8)
    port = data_port(d, token=TOKEN_A)
    held = [hello(port, TOKEN_A), hello(port, TOKEN_A)]
    for sock in held:  # admitted before the third says hello: the daemon serves hellos in any order
        assert read_frame(sock) == (READY, b"")
    third = hello(port, TOKEN_A)
    assert "share of data_max_connections" in expect_error(third, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert closed(third)
    strangers = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    time.sleep(0.3)  # the daemon has accepted them: they wait for a token
    extra = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert closed(strangers[0])  # the longest waiting made room
    b = hello(port, TOKEN_B)  # tenant b still gets in, and is served
    assert read_frame(b) == (READY, b"")
    b.sendall(frame(GET, pb.GetRequest(allow_missing=True).SerializeToString()))
    assert read_frame(b)[0] == GET_REPLY
    for sock in held + strangers + [third, extra, b]:
        sock.close()


def test_put_reply_frame_and_a_raw_round_trip(daemon_factory):
    """The protocol as documented, with no client library: PUT then GET of one block."""
    d = serve(daemon_factory)
    keys, stored = blocks(10)
    key, tokens, payload = stored[1]
    sock = hello(data_port(d))
    sock.sendall(put_message(key, tokens) + payload.tobytes())
    kind, body = read_frame(sock)
    assert kind == PUT_REPLY and pb.PutResponse.FromString(body).stored == 1
    sock.sendall(frame(GET, pb.GetRequest(items=[pb.GetItem(key=key)]).SerializeToString()))
    kind, body = read_frame(sock)
    result = pb.GetResponse.FromString(body).results[0]
    assert kind == GET_REPLY and result.found and result.meta.payload_len == len(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(len(payload) - len(got))
    assert got == payload.tobytes()
    sock.close()


def test_a_peer_that_trickles_its_hello_or_fills_the_cap_never_locks_tenants_out(daemon_factory):
    """A HELLO (or TLS handshake) that trickles in is closed HELLO_TIMEOUT_S after accept, however
    slowly its bytes come; at the cap, a new connection closes the longest waiting one, so a client
    that sends its token at once always gets in."""
    d = serve(daemon_factory, data_max_connections=4)
    port = data_port(d)
    admitted = [hello(port), hello(port)]  # idle, as a client's pool keeps them
    trickling = []
    for _ in range(2):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(FRAME_HEAD.pack(HELLO, len(TOKEN))[:2])  # half a frame head, then nothing
        trickling.append(sock)
    started = time.monotonic()
    newcomer = hello(port)  # at the cap (2 admitted + 2 waiting): the longest waiting makes room
    newcomer.sendall(frame(GET, pb.GetRequest(allow_missing=True).SerializeToString()))
    assert read_frame(newcomer)[0] == GET_REPLY
    assert closed(trickling[0])
    for sock in trickling[1:]:  # the rest: closed once they waited HELLO_TIMEOUT_S in all
        sock.sendall(b"\x00")
        assert closed(sock)
    assert time.monotonic() - started < 15
    for sock in admitted + trickling + [newcomer]:
        sock.close()


def test_a_pooled_connection_the_daemon_closed_is_replaced_once(daemon_factory):
    d = serve(daemon_factory)
    keys, stored = blocks(11)
    with KVStoreClient(d.address, token=TOKEN, shared_memory=False) as c:
        assert c.put(NS, stored) == len(stored)
        for conn in c._data._idle:  # as when the daemon ended them (idle timeout, restart)
            conn._sock.shutdown(socket.SHUT_RDWR)
        assert c.get(keys, LAYOUT.block_bytes(64)) == [p.tobytes() for _, _, p in stored]
        for conn in c._data._idle:
            conn._sock.shutdown(socket.SHUT_RDWR)
        assert c.put(NS, stored) == len(stored)


def test_a_tenant_that_trickles_a_put_holds_the_budget_seconds_and_starves_no_one(daemon_factory, short_tmp):
    """Tenant a sends a Put's head and then trickles nothing: the other tenant's Put and Get go
    through meanwhile, and the daemon ends a's transfer at its deadline (TRANSFER_MIN_S at 8 MB/s),
    releasing the bytes it held."""
    tenants = short_tmp / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "a"\ntoken = "{TOKEN_A}"\n\n[[tenant]]\nname = "b"\ntoken = "{TOKEN_B}"\n')
    tenants.chmod(0o600)
    budget = 64 * 2**20
    d = serve(daemon_factory, tenants_file=str(tenants), max_message_bytes=budget)
    port = data_port(d, token=TOKEN_A)
    tokens, count = 64, 200  # 200 blocks of 30 KiB: about 6 MiB held while it trickles
    keys = prefix_keys(NS, np.random.default_rng(1).integers(0, 49152, size=count * tokens))
    items = [pb.PutItem(meta=pb.BlockMeta(key=k, namespace=NS.id, layout=layout_message(LAYOUT), tokens=tokens,
                                          codec="raw", payload_len=LAYOUT.block_bytes(tokens))) for k in keys]
    started = time.monotonic()
    first = hello(port, TOKEN_A)
    assert read_frame(first) == (READY, b"")
    first.sendall(frame(PUT, pb.PutRequest(items=items).SerializeToString()) + b"\x01" * 4096)
    theirs, stored = blocks(12)
    with KVStoreClient(d.address, token=TOKEN_B, shared_memory=False) as b:
        assert b.put(NS, stored) == len(stored)
        assert b.get(theirs, LAYOUT.block_bytes(64)) == [p.tobytes() for _, _, p in stored]
    first.settimeout(30)
    assert first.recv(1 << 16) == b"", "the daemon closes a transfer past its deadline"
    assert time.monotonic() - started < 15  # the 5 s minimum, not a read timeout per byte
    with KVStoreClient(d.address, token=TOKEN_A, shared_memory=False) as a:
        assert a.put(NS, stored) == len(stored)  # a's share is free again
    first.close()


class Impostor:
    """Another local user's listener on a loopback port: it records what reaches it and answers
    READY and a forged Get reply, as the attack in issue 56 did."""

    def __init__(self, host: str, port: int) -> None:
        self.listener = socket.create_server((host, port))
        self.listener.settimeout(0.2)
        self.received, self.connections = b"", 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1.0)
                try:
                    self.received += conn.recv(1 << 16)
                    conn.sendall(frame(READY))
                    self.received += conn.recv(1 << 16)
                    forged = pb.GetResponse(results=[pb.GetResult(found=True, meta=pb.BlockMeta(payload_len=16))])
                    conn.sendall(frame(GET_REPLY, forged.SerializeToString()) + b"EVIL-EVIL-EVIL!!")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.listener.close()


@pytest.mark.parametrize("grpc_on", ["unix", "tcp"])
def test_an_impostor_on_a_loopback_port_gets_no_token_and_serves_no_bytes(daemon_factory, grpc_on):
    """The data channel on 127.0.0.2 and another user's listener on 127.0.0.1 at its port: a client
    on the unix socket dials the unix socket beside it, one over TCP the host the daemon advertises;
    neither sends its token to 127.0.0.1 nor takes its bytes (on ee82bf6 both dialled 127.0.0.1)."""
    listen = {"unix": {}, "tcp": {"listen": f"127.0.0.1:{free_port()}"}}[grpc_on]
    d = daemon_factory("d0", data_listen="127.0.0.2:0", auth_token=TOKEN, **listen)
    port = data_port(d)
    impostor = Impostor("127.0.0.1", port)
    try:
        assert_round_trip(d.address, seed=21, token=TOKEN)
        with KVStoreClient(d.address, token=TOKEN, shared_memory=False) as c:
            assert c.data_channel
            assert str(c._data.endpoint) == (f"unix:{d.socket}.data" if grpc_on == "unix" else f"127.0.0.2:{port}")
    finally:
        impostor.close()
    assert impostor.connections == 0 and TOKEN.encode() not in impostor.received


def test_the_pool_learns_the_new_port_after_a_restart_and_never_dials_the_old_one(daemon_factory):
    """A daemon restarted on a new data port, the old one taken by another user: the client's pool,
    whose kept connection the restart closed, asks the daemon where its channel is now."""
    d = serve(daemon_factory)
    keys, stored = blocks(22)
    with KVStoreClient(d.address, token=TOKEN, shared_memory=False) as c:
        assert c.put(NS, stored) == len(stored)
        old = c._data.endpoint.port
        d.stop()
        impostor = Impostor("127.0.0.1", old)
        try:
            d.start()  # same gRPC port, a new data port (the old one is taken)
            c.wait_ready()
            got = c.get(keys, LAYOUT.block_bytes(64))  # from the disk tier the first run wrote through
            assert c._data.endpoint.port not in (0, old)
        finally:
            impostor.close()
    assert impostor.connections == 0 and TOKEN.encode() not in impostor.received
    assert got == [p.tobytes() for _, _, p in stored]


def test_a_unix_data_socket_served_by_another_user_is_refused_before_the_token(daemon_factory):
    """The peer of the unix data socket must run as the owner of the daemon's socket (SO_PEERCRED):
    dialled as if the daemon were another user's, nothing is sent."""
    from engine_adapter.client.data_channel import DataEndpoint, ImpostorError

    d = daemon_factory("d0", data_listen="127.0.0.1:0", auth_token=TOKEN)
    endpoint = DataEndpoint.advertised(d.address, data_port(d), "")
    assert endpoint.unix_path == f"{d.socket}.data" and endpoint.owner_uid == os.getuid()
    assert stat.S_IMODE(os.stat(endpoint.unix_path).st_mode) == 0o600
    with pytest.raises(ImpostorError, match="not by the daemon's user"):
        DataEndpoint(unix_path=endpoint.unix_path, owner_uid=os.getuid() + 1).dial(None, timeout=5)


def test_one_byte_of_a_frame_head_holds_a_connection_seconds_not_minutes(daemon_factory):
    """The rest of a frame's head comes within READ_TIMEOUT_S (10 s) of its first byte, or the
    daemon closes the connection (on ee82bf6 one byte held it for the 300 s idle timeout)."""
    d = serve(daemon_factory)
    sock = hello(data_port(d))
    sock.sendall(bytes([GET]))  # one byte of a five-byte head, then nothing
    sock.settimeout(60)
    assert closed(sock)
    sock.close()


def test_the_start_log_says_tls_where_the_data_channel_has_it(daemon_factory, short_tmp):
    """gRPC on the unix socket, the data channel on TCP with the certificate: the start log says
    the channel's TLS is on, and names its unix socket (on ee82bf6 it said "TLS off")."""
    cert, key = _self_signed(short_tmp)
    d = daemon_factory("d0", data_listen="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN,
                       log_level="INFO")
    line = next(line for line in d.log.read_text().splitlines() if "data channel on" in line)
    assert "TLS on" in line and f"{d.socket}.data" in line, line
