"""How any client reaches a daemon: TLS, bearer tokens, and one line saying why it could not.
Shared by `engine_adapter.client.kvstore_client.KVStoreClient`, `kvstore.locate` and the CLI's client commands.

- TLS (`ClientTLS`) applies to TCP addresses; a unix socket is private already (mode 0600) and
  is always plaintext.
- Where a client's settings come from (`client_settings`, every client: the CLI's commands,
  `KVStoreClient`, the vLLM connector, `locate`): the caller's arguments (flags), then the
  ``KVSTORE_*`` environment, then the daemon's own config file (``--config`` / ``KVSTORE_CONFIG``:
  its ``listen``, its tokens, and a ``[client]`` table the daemon skips).
- A bearer token comes from the caller, else a token file (`TokenBook`: one token, or one per
  address), else ``KVSTORE_AUTH_TOKEN``, else the config file.
- A token is never sent over plaintext TCP to an address that is not loopback unless the caller
  says ``insecure`` (`plaintext_token_refusal`).
- A call that fails is explained in one line (`explain`, `DaemonError`): no daemon there, a TLS
  port met in plaintext or a plaintext port met with TLS, a certificate the CA does not vouch for,
  a token refused.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import grpc

from kvstore.host import default_listen, is_loopback_host, readable_by_others
from kvstore.user_input import parse_bool, read_toml

log = logging.getLogger(__name__)

#: The client's environment: a bearer token (the daemon reads the same variable as its own token),
#: and, for the CLI, the CA that signed TCP daemons' certificates.
TOKEN_ENV = "KVSTORE_AUTH_TOKEN"
TLS_CA_ENV = "KVSTORE_TLS_CA"
#: The daemon's address (its own ``listen`` setting), the name its certificate carries, and the
#: config file both read (``kvstore serve --config``; kvstore/daemon/config.py reads it too).
ADDRESS_ENV = "KVSTORE_LISTEN"
TLS_SERVER_NAME_ENV = "KVSTORE_TLS_SERVER_NAME"
CONFIG_ENV = "KVSTORE_CONFIG"
#: The config file's table for clients only (the daemon skips it): how to reach the daemon where
#: its own settings do not say (a CA, the certificate's name, a token file, a client certificate).
CLIENT_TABLE = "client"
CLIENT_KEYS = ("address", "token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "insecure")


@dataclass(frozen=True)
class OptionNames:
    """How the caller's settings are spelled, for the fix a message names."""

    ca: str
    client_cert: str
    server_name: str
    token: str
    insecure: str


#: `KVStoreClient`'s arguments (also the vLLM connector's `kv_connector_extra_config` keys).
PYTHON_OPTIONS = OptionNames(ca="tls_ca", client_cert="tls_cert and tls_key", server_name="tls_server_name",
                             token="token_file or KVSTORE_AUTH_TOKEN", insecure="insecure")
#: The CLI's client commands (stats, clear, ingest, locate).
CLI_OPTIONS = OptionNames(ca=f"--tls-ca (or {TLS_CA_ENV})", client_cert="--tls-cert and --tls-key",
                          server_name="--tls-server-name", token=f"--token-file FILE or {TOKEN_ENV}",
                          insecure="--insecure")


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks a TCP daemon's certificate and, optionally, shows its own.

    Each of ``ca``, ``cert`` and ``key`` is a PEM file's path or its bytes. ``server_name``: the
    name the daemon's certificate must carry, when the address names the host otherwise (e.g. an IP).
    """

    ca: str | bytes
    cert: str | bytes | None = None
    key: str | bytes | None = None
    server_name: str = ""

    def __post_init__(self) -> None:
        if not self.ca:
            raise ValueError("TLS needs the CA certificate (PEM) that signed the daemon's certificate")
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS client certificate needs its private key too (and the key its certificate)")

    def pem(self, what: str) -> bytes | None:
        """The PEM bytes of ``ca``, ``cert`` or ``key``; ValueError naming the file it cannot use."""
        source = getattr(self, what)
        if source is None or isinstance(source, bytes):
            return source
        label = {"ca": "CA certificate", "cert": "client certificate", "key": "client key"}[what]
        try:
            data = open(source, "rb").read()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS {label} {source}: {exc.strerror}") from None
        if b"-----BEGIN" not in data:
            raise ValueError(f"the TLS {label} {source} is not a PEM file")
        return data

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.pem("ca"), private_key=self.pem("key"),
                                            certificate_chain=self.pem("cert"))

    def ssl_context(self) -> ssl.SSLContext:
        """The same checks for a plain TLS socket (the data channel): the daemon's certificate
        signed by ``ca`` and naming the host (or ``server_name``: see `server_hostname`). The
        daemon asks for no client certificate, so none is shown."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=self.pem("ca").decode("ascii", "replace"))
        return context

    def server_hostname(self, host: str) -> str:
        return self.server_name or host


def client_tls(ca: str | bytes | None = None, cert: str | bytes | None = None, key: str | bytes | None = None,
               server_name: str = "", environ: Mapping[str, str] | None = None,
               names: OptionNames = PYTHON_OPTIONS) -> ClientTLS | None:
    """The TLS settings given (``ca`` else ``KVSTORE_TLS_CA`` when ``environ`` is given), or None
    for plaintext; ValueError when a client certificate or server name comes without a CA."""
    if ca is None and environ is not None:
        ca = environ.get(TLS_CA_ENV) or None
    if ca is None:
        if cert is not None or key is not None or server_name:
            raise ValueError(f"{names.client_cert} and {names.server_name} apply to TLS: give {names.ca} too")
        return None
    return ClientTLS(ca, cert, key, server_name)


@dataclass(frozen=True)
class ClientSettings:
    """How one client reaches its daemon, resolved (`client_settings`)."""

    address: str
    token: str | None
    tls: ClientTLS | None  # for TCP addresses: a unix socket is always plaintext
    insecure: bool


def read_client_table(config_file: str | os.PathLike) -> dict[str, Any]:
    """What a client takes from the daemon's config file: its ``listen`` (as ``address``), its
    ``auth_token`` and admin token, and the ``[client]`` table's keys; ValueError naming the file."""
    table = read_toml(config_file, "config file")
    client = table.get(CLIENT_TABLE, {})
    if not isinstance(client, dict) or set(client) - set(CLIENT_KEYS):
        raise ValueError(f"config file {config_file}: [{CLIENT_TABLE}] takes only {list(CLIENT_KEYS)}")
    found = {key: client[key] for key in CLIENT_KEYS if key in client}
    if "address" not in found and table.get("listen"):
        found["address"] = reachable_address(str(table["listen"]))
    for key in ("auth_token", "admin_token", "admin_token_file"):
        if table.get(key):
            found[key] = str(table[key])
    return found


def reachable_address(listen: str) -> str:
    """The address a client on the same host uses for a daemon listening on ``listen``: a
    wildcard host (0.0.0.0, [::]) becomes loopback."""
    if is_unix(listen):
        return listen
    host, port = _host_port(listen)
    if host in ("0.0.0.0", "", "*"):
        return f"127.0.0.1:{port}"
    if host == "::":
        return f"[::1]:{port}"
    return listen


def client_settings(address: str | None = None, token: str | None = None,
                    token_file: str | os.PathLike | None = None, tls_ca: str | bytes | None = None,
                    tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                    tls_server_name: str | None = None, insecure: bool | None = None,
                    config_file: str | os.PathLike | None = None, admin: bool = False,
                    environ: Mapping[str, str] | None = None, names: OptionNames = PYTHON_OPTIONS) -> ClientSettings:
    """Each setting from the caller (flags, arguments), else the ``KVSTORE_*`` environment, else
    the daemon's config file (``config_file`` else ``KVSTORE_CONFIG``: `read_client_table`), else
    the default (``kvstore serve``'s socket, no token, plaintext). ``admin``: the operator's
    command (stats, clear), which takes the file's admin token before its ``auth_token``.
    ValueError, one line, for a file or a combination that cannot be used."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(CONFIG_ENV) or None
    found = read_client_table(config_file) if config_file else {}
    address = address or environ.get(ADDRESS_ENV) or found.get("address") or default_listen()
    address = reachable_address(address)
    token = resolve_token(token, token_file, address, environ)
    if token is None and found.get("token_file"):
        token = TokenBook.read(found["token_file"]).for_address(address)
    if token is None:
        file_admin = found.get("admin_token") or (_one_line(found["admin_token_file"]) if found.get("admin_token_file")
                                                  else None)
        token = (file_admin if admin else None) or found.get("auth_token") or file_admin or None
    tls = client_tls(tls_ca or environ.get(TLS_CA_ENV) or found.get("tls_ca") or None,
                     tls_cert or found.get("tls_cert") or None, tls_key or found.get("tls_key") or None,
                     tls_server_name or environ.get(TLS_SERVER_NAME_ENV) or found.get("tls_server_name") or "",
                     names=names)  # for TCP addresses (`locate` may ask several); a unix socket is plaintext
    if insecure is None:
        insecure = parse_bool(found.get("insecure", False)) if "insecure" in found else False
    return ClientSettings(address, token, tls, bool(insecure))


def _one_line(path: str) -> str | None:
    """A token file's one token (the admin token file the daemon reads); None when unreadable (not
    the operator: the daemon's files are its own)."""
    try:
        return TokenBook.read(path).default
    except ValueError:
        return None


class DaemonError(grpc.RpcError):
    """A call to a daemon that failed, in one line with its fix (``str``); ``code()`` and
    ``details()`` are gRPC's, so a caller that handles `grpc.RpcError` handles it the same."""

    def __init__(self, cause: grpc.RpcError, reason: str) -> None:
        super().__init__(reason)
        self.cause, self.reason = cause, reason

    def code(self) -> grpc.StatusCode:
        return self.cause.code()

    def details(self) -> str:
        return self.reason

    def __str__(self) -> str:
        return self.reason


def is_unix(address: str) -> bool:
    return address.startswith("unix:") or address.startswith("unix-abstract:")


def _host_port(address: str) -> tuple[str, int | None]:
    """``host:port`` (also ``[v6]:port``, ``dns:///host:port``, ``ipv4:``/``ipv6:``) -> (host, port)."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
            break
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif address.count(":") == 1:
        host, _, port = address.partition(":")
    else:
        host, port = address, ""
    return host, int(port) if port.isdigit() else None


def is_loopback(address: str) -> bool:
    """True for a unix socket and for a TCP address whose host is loopback by address
    (`kvstore.host.is_loopback_host`: `localhost.example.com` counts only if it resolves there)."""
    return is_unix(address) or is_loopback_host(_host_port(address)[0])


def plaintext_token_refusal(address: str, tls: ClientTLS | None, token: str | None, insecure: bool,
                            names: OptionNames = PYTHON_OPTIONS) -> str | None:
    """Why a token must not go to ``address`` as asked (plaintext TCP, not loopback), or None."""
    if not token or tls is not None or insecure or is_loopback(address):
        return None
    return (f"refusing to send a bearer token in plaintext to {address} (not a loopback address): "
            f"give {names.ca} for TLS, or {names.insecure} on a network you trust")


def open_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to ``address``: TLS when ``tls`` is given and the address is TCP (a unix socket
    is always plaintext)."""
    options = list(options)
    if tls is None or is_unix(address):
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, tls.credentials(), options=options)


@dataclass(frozen=True)
class TokenBook:
    """Bearer tokens from a file: one for every daemon, or one per address.

    The file holds one token; or lines ``ADDRESS TOKEN`` (``#`` starts a comment; a line of one
    token is the default for addresses not listed); or TOML::

        token = "default for addresses not listed"      # optional
        [hosts."10.0.0.5:7070"]
        token = "..."

    Addresses match as written (in ``--hosts``, ``--address``, ``kv_connector_extra_config``).
    """

    default: str | None = None
    hosts: Mapping[str, str] = field(default_factory=dict)

    def for_address(self, address: str) -> str | None:
        return self.hosts.get(address, self.default)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "TokenBook":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"the token file {path} is not UTF-8 text") from None
        warning = readable_by_others(path)
        if warning:
            log.warning("token file %s", warning)
        try:
            parsed = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            parsed = None
        book = cls._from_toml(path, parsed) if parsed and {"token", "hosts"} & set(parsed) \
            else cls._from_lines(path, text)
        if book.default is None and not book.hosts:
            raise ValueError(f"the token file {path} holds no token")
        return book

    @classmethod
    def _from_toml(cls, path, parsed: dict) -> "TokenBook":
        unknown = sorted(set(parsed) - {"token", "hosts"})
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; a token file has 'token' and [hosts.\"ADDRESS\"] tables")
        default = parsed.get("token")
        if default is not None and (not isinstance(default, str) or not default):
            raise ValueError(f"{path}: 'token' must be a non-empty string")
        hosts: dict[str, str] = {}
        for address, entry in dict(parsed.get("hosts", {})).items():
            token = entry.get("token") if isinstance(entry, dict) else entry
            if not isinstance(token, str) or not token or (isinstance(entry, dict) and set(entry) - {"token"}):
                raise ValueError(f"{path}: [hosts.\"{address}\"] needs token = \"...\" (and nothing else)")
            hosts[address] = token
        return cls(default, hosts)

    @classmethod
    def _from_lines(cls, path, text: str) -> "TokenBook":
        default: str | None = None
        hosts: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(f"{path}: line {number}: expected 'ADDRESS TOKEN' or one token")
            if len(fields) == 1:
                if default is not None:
                    raise ValueError(f"{path}: line {number}: a second token without an address "
                                     f"(write 'ADDRESS TOKEN' for each daemon)")
                default = fields[0]
            else:
                if fields[0] in hosts:
                    raise ValueError(f"{path}: line {number}: {fields[0]} is listed twice")
                hosts[fields[0]] = fields[1]
        return cls(default, hosts)


def resolve_token(token: str | None, token_file: str | os.PathLike | None, address: str,
                  environ: Mapping[str, str] | None = None) -> str | None:
    """The token for ``address``: ``token``, else the token file's entry for it, else
    ``KVSTORE_AUTH_TOKEN``; None when there is none."""
    if token:
        return token
    if token_file:
        found = TokenBook.read(token_file).for_address(address)
        if found:
            return found
    return (os.environ if environ is None else environ).get(TOKEN_ENV) or None


def explain(exc: grpc.RpcError, address: str, tls: ClientTLS | None, token: str | None,
            probe_timeout: float = 1.0, names: OptionNames = PYTHON_OPTIONS) -> str | None:
    """One line saying why a call to ``address`` failed and what fixes it, where that is known;
    None otherwise. A failed connection is probed again (on TCP with a TLS handshake) to tell
    no daemon, a TLS port met in plaintext, a plaintext port met with TLS, or a certificate."""
    code = exc.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        given = "" if token else " (none was given)"
        return f"{address} refused the bearer token{given}: pass the daemon's token with {names.token}"
    if code == grpc.StatusCode.UNAVAILABLE and "http1.x server" in (exc.details() or ""):
        return (f"{address} answers HTTP/1.1, not gRPC: it is the daemon's metrics port (metrics_listen: "
                f"/metrics, /healthz, /readyz); give the address the daemon listens on (listen)")
    if code == grpc.StatusCode.UNAVAILABLE and probe_timeout > 0:
        return diagnose(address, tls, probe_timeout, names)
    return None


def diagnose(address: str, tls: ClientTLS | None, timeout: float = 1.0,
             names: OptionNames = PYTHON_OPTIONS) -> str | None:
    """Why ``address`` cannot be reached as asked, in one line; None when a probe finds nothing
    wrong with the connection itself (or cannot tell)."""
    if is_unix(address):
        path = address.split(":", 1)[1]
        path = path[2:] if path.startswith("//") else path
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(timeout)
            try:
                probe.connect(path if address.startswith("unix:") else "\0" + path)
            except (FileNotFoundError, ConnectionRefusedError):
                return f"no daemon at {address} (is `kvstore serve` running?)"
            except PermissionError:
                return f"{address}: permission denied (the socket is 0600: run as the daemon's user)"
            except OSError as exc:
                return f"{address}: {exc.strerror or exc}"
        return None
    host, port = _host_port(address)
    if port is None:
        return f"{address}: not host:port or unix:/path"
    try:
        speaks_tls = _speaks_tls(host, port, timeout)
    except (ConnectionRefusedError, ConnectionResetError):
        return f"no daemon at {address} (is `kvstore serve` running?)"
    except socket.gaierror as exc:
        return f"{address}: unknown host ({exc.strerror})"
    except (socket.timeout, TimeoutError):
        return f"{address} did not answer within {timeout:g} s"
    except OSError as exc:
        return f"{address}: {exc.strerror or exc}"
    if speaks_tls is None:
        return None
    if speaks_tls and tls is None:
        return f"{address} speaks TLS: pass {names.ca}"
    if not speaks_tls and tls is not None:
        return f"{address} does not speak TLS (it answers in plaintext): drop {names.ca}"
    if tls is not None:
        return _certificate_problem(address, host, port, tls, timeout, names)
    return None


def _speaks_tls(host: str, port: int, timeout: float) -> bool | None:
    """Whether the TCP server answers a TLS ClientHello as a TLS server (None: cannot tell).
    Raises OSError when it cannot be reached at all."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=host if not _is_ip(host) else None):
                return True
        except ssl.SSLError as exc:
            # A TLS server answers with an alert; a plaintext gRPC server sends HTTP/2 bytes
            # (WRONG_VERSION_NUMBER, record layer failure) or closes (EOF).
            return "ALERT" in (exc.reason or "").upper()
        except (ConnectionResetError, BrokenPipeError):
            return False
        except (socket.timeout, TimeoutError):
            return None


def _certificate_problem(address: str, host: str, port: int, tls: ClientTLS, timeout: float,
                         names: OptionNames) -> str | None:
    """A TLS port met with TLS: is its certificate one ``tls`` accepts, and does it ask for ours?"""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    try:
        context.load_verify_locations(cadata=tls.pem("ca").decode("ascii", "replace"))
    except ssl.SSLError as exc:
        return f"the TLS CA certificate given cannot be used ({exc.reason or exc}): check {names.ca}"
    name = tls.server_name or host
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=name) as conn:
            if tls.cert is None:
                conn.settimeout(min(timeout, 0.5))
                conn.recv(1)  # a TLS 1.3 server that wants a client certificate says so here
    except ssl.SSLCertVerificationError as exc:
        why = (exc.verify_message or str(exc)).rstrip(".")
        if "mismatch" in why.lower():
            return (f"{address}: its TLS certificate is not for {name} ({why}): connect by a name it carries, "
                    f"or pass {names.server_name}")
        return f"{address}: its TLS certificate is not signed by the CA given ({why}): pass that CA as {names.ca}"
    except ssl.SSLError as exc:
        if "CERTIFICATE_REQUIRED" in (exc.reason or "").upper() or "HANDSHAKE_FAILURE" in (exc.reason or "").upper():
            return f"{address} asks for a TLS client certificate: pass {names.client_cert}"
        return f"{address}: TLS failed ({exc.reason or exc})"
    except OSError:
        return None
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
