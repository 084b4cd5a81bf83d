"""Tenants, quotas, tokens and TLS against a real daemon."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import stat

import grpc
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from tests.test_daemon import BLOCK, NS, make_blocks


def _tenants_file(folder, quota_b="0"):
    path = folder / "tenants.toml"
    path.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n\n'
                    f'[[tenant]]\nname = "b"\ntoken = "token-b-0123456789"\nquota = "{quota_b}"\n')
    return path


def test_a_tenant_cannot_see_read_delete_or_pin_another_tenants_blocks(daemon_factory, short_tmp):
    d = daemon_factory(tenants_file=_tenants_file(short_tmp))
    keys, payloads = make_blocks(3, seed=20)
    with KVStoreClient(d.address, token="token-a-0123456789") as a, \
            KVStoreClient(d.address, token="token-b-0123456789") as b:
        a.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert a.lookup(keys).hits == 3
        assert b.lookup(keys).hits == 0                      # look up
        assert b.get(keys, BLOCK) == [None, None, None]      # read
        assert b.delete(keys) == 0                           # delete
        with pytest.raises(grpc.RpcError) as info:           # pin
            b.pin(keys)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:           # and no tenant may clear the others
            b.clear()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert a.get(keys, BLOCK) == [p.tobytes() for p in payloads]
        assert a.pin(keys[:1]) == 1 and a.delete(keys[2:]) == 1
    for token in (None, "token-c"):
        with KVStoreClient(d.address, token=token, shared_memory=False) as nobody:
            with pytest.raises(grpc.RpcError) as info:
                nobody.lookup(keys)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_over_its_quota_evicts_its_own_blocks_first(daemon_factory, short_tmp):
    d = daemon_factory(tenants_file=_tenants_file(short_tmp, quota_b=f"{3 * BLOCK + 3 * 4096}"),
                       write_policy="write-back", cpu_capacity="16MiB")
    keys_a, payloads_a = make_blocks(4, seed=21)
    keys_b, payloads_b = make_blocks(6, seed=22)
    with KVStoreClient(d.address, token="token-a-0123456789") as a, \
            KVStoreClient(d.address, token="token-b-0123456789") as b:
        a.put(NS, [(k, 64, p) for k, p in zip(keys_a, payloads_a)])
        b.put(NS, [(k, 64, p) for k, p in zip(keys_b, payloads_b)])
        tiers_b = b.lookup(keys_b).tiers
        assert tiers_b.count("cpu") == 3 and tiers_b[:3] == ("disk",) * 3   # B's oldest were demoted
        assert a.lookup(keys_a).tiers == ("cpu",) * 4                       # A was not touched
        assert b.get(keys_b, BLOCK) == [p.tobytes() for p in payloads_b]    # nothing lost


def _self_signed(folder):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tcp_with_tls_and_a_token(daemon_factory, short_tmp):
    cert, key = _self_signed(short_tmp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon_factory(listen=f"127.0.0.1:{port}", auth_token="s3cret-0123456789ab", tls_cert=cert, tls_key=key)
    keys, payloads = make_blocks(1, seed=23)
    with KVStoreClient(f"127.0.0.1:{port}", token="s3cret-0123456789ab", tls_ca=str(cert)) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])
        assert client.get(keys, BLOCK) == [payloads[0].tobytes()]
    with KVStoreClient(f"127.0.0.1:{port}", token="s3cret-0123456789ab", timeout=5) as plaintext:
        with pytest.raises(grpc.RpcError) as info:
            plaintext.lookup(keys)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_vllm_access_trace_is_private_and_follows_no_symlink(tmp_path):
    """The connector's trace file (request ids, prefix keys) is created 0600, a file of this user's
    left readable is made 0600, and a symlink another user planted at its path, or a file another
    user owns, is refused (on ee82bf6: created 0644, and the symlink followed)."""
    from engine_adapter.vllm.trace import AccessTrace
    from kvstore.keys import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    fresh = tmp_path / "trace.jsonl"
    AccessTrace(str(fresh), layout, 16).close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    loose = tmp_path / "old-trace.jsonl"
    loose.write_text("")
    loose.chmod(0o644)
    AccessTrace(str(loose), layout, 16).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600
    target = tmp_path / "victim.txt"
    target.write_text("someone else's\n")
    planted = tmp_path / "planted.jsonl"
    planted.symlink_to(target)
    with pytest.raises(OSError):
        AccessTrace(str(planted), layout, 16)
    assert target.read_text() == "someone else's\n"
    if os.geteuid() == 0:  # a file another user owns (only root can make one here)
        theirs = tmp_path / "theirs.jsonl"
        theirs.write_text("")
        os.chown(theirs, 65534, 65534)
        with pytest.raises(OSError, match="not a regular file of this user's"):
            AccessTrace(str(theirs), layout, 16)
