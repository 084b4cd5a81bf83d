"""The connector's settings: `ConnectorSettings`, read once from vLLM's ``kv_connector_extra_config``.

Their own module, below the connector's two sides (`scheduler`, `worker`) and the connector that
builds them, so each side reads its settings without importing the connector. Importing it does not
import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from blend.controller import Ratio
from blend.prompt import DEFAULT_RATIO
from blend.select import DEFAULT_SELECTOR, check_selector

SAVE_MODES = ("auto", "async", "sync", "durable")
BLEND_MODES = ("off", "lazy", "start")
BLEND_WEIGHTS = ("vllm", "copy")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys, validated."""

    address: str = ""            # daemon address, e.g. "unix:/run/kvstore.sock"; default: KVSTORE_LISTEN, else the
                                 # config file's listen, else kvstore's default socket (kvstore.connect.client_settings)
    config_file: str = ""        # the daemon's config file (default: KVSTORE_CONFIG): address, tokens, [client] TLS
    model_id: str = ""           # namespace model id; default: the model folder's name (the GGUF stem)
    tenant: str = ""             # namespace tenant salt
    chunk_tokens: int = 256      # tokens per block; must match the other engines sharing the cache
    arena_bytes: int = 64 << 20  # worker's shared-memory arena
    timeout_s: float = 5.0       # per daemon call
    retry_s: float = 10.0        # after a failed call, serve without the daemon this long
    save_queue_chunks: int = 16  # completed chunks waiting for Put; beyond it they are dropped (counted)
    tail_blocks: bool = True     # also store/load the tokens after the last full chunk, up to the last page
    lease_s: float = 10.0        # the daemon keeps a reported hit from eviction this long (0: no lease)
    layerwise: bool = False      # write layer i's pages while vLLM computes layer i-1 (docs/vllm.md: measured)
    native_copy: bool = True     # CPU pages written by kvstore's native page writer where it knows the
                                 # layout (kernels/page_copy.c); false: vLLM's own cache-write op
    event_tier: str = "cpu"      # the daemon tier a Put lands in, named in vLLM's KV events (medium, ownership)
    save_mode: str = "auto"      # async: Put from a thread; sync: Put in the step; durable: sync, and on
                                 # disk or S3 when the step ends; auto: sync for kv_producer, else async
    blend: str = "lazy"          # CacheBlend for requests that ask (engine_adapter/vllm/blend.py): "lazy" sets
                                 # the blend's model up on the first such request, "start" at start, "off"
                                 # serves them as plain prompts
    blend_weights: str = "vllm"  # the blend computes with vLLM's own layers (engine_adapter/vllm/model_view.py;
                                 # a second copy where they do not fit), or "copy": its own copy of the
                                 # weights from the model folder
    blend_ratio: float = DEFAULT_RATIO  # fraction of passage tokens recomputed, unless a request says
    blend_selector: str = DEFAULT_SELECTOR  # blend.select name, unless a request says
    blend_controller: bool = False  # the ratio from measured load and compute speed (blend/controller.py)
                                    # for requests that give none (or "auto"); blend_ratio is its floor
    blend_separator: str = ""       # a prompt whose text holds it is a blend of the passages it marks
                                    # (prefix<sep>passage<sep>...<sep>query, e.g. "<|chunk|>"); "": off
                                    # (opt in: quality is below kv_transfer_params', docs/vllm.md)
    blend_max_passages: int = 128   # a request marking more is served as a plain prompt
    token_file: str = ""         # the daemon's bearer token (or one per address, kvstore.connect.TokenBook);
                                 # default: KVSTORE_AUTH_TOKEN
    tls_ca: str = ""             # TLS to a TCP daemon: PEM of the CA that signed its certificate; default: KVSTORE_TLS_CA
    tls_cert: str = ""           # client certificate (PEM, with tls_key) for a daemon that asks for one
    tls_key: str = ""
    tls_server_name: str = ""    # the name the daemon's certificate carries, when the address names it otherwise
    insecure: bool = False       # allow the token over plaintext TCP to an address that is not loopback
    trace_file: str = ""         # append the scheduler's block access trace here (engine_adapter/vllm/trace.py)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorSettings":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown} for KVStoreConnector; "
                             f"known keys: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(known[name].default)
            try:
                if kind is bool and not isinstance(value, bool):
                    value = {"true": True, "1": True, "false": False, "0": False}[str(value).strip().lower()]
                values[name] = kind(value)
            except (TypeError, ValueError, KeyError):
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be a {kind.__name__}, "
                                 f"got {value!r}") from None
        settings = cls(**values)
        for name in ("chunk_tokens", "arena_bytes", "save_queue_chunks", "blend_max_passages"):
            if getattr(settings, name) <= 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be positive, got {getattr(settings, name)}")
        if settings.save_mode not in SAVE_MODES:
            raise ValueError(f"kv_connector_extra_config['save_mode'] must be one of {SAVE_MODES}, "
                             f"got {settings.save_mode!r}")
        if settings.blend not in BLEND_MODES:
            raise ValueError(f"kv_connector_extra_config['blend'] must be one of {BLEND_MODES}, got {settings.blend!r}")
        if settings.blend_weights not in BLEND_WEIGHTS:
            raise ValueError(f"kv_connector_extra_config['blend_weights'] must be one of {BLEND_WEIGHTS}, "
                             f"got {settings.blend_weights!r}")
        for name, check in (("blend_ratio", Ratio), ("blend_selector", check_selector)):
            try:
                check(getattr(settings, name))
            except ValueError as exc:
                raise ValueError(f"kv_connector_extra_config[{name!r}]: {exc}") from None
        if settings.timeout_s <= 0 or settings.retry_s < 0 or settings.lease_s < 0:
            raise ValueError("kv_connector_extra_config 'timeout_s' must be > 0, 'retry_s' and 'lease_s' >= 0")
        return settings

    @property
    def default_blend_ratio(self) -> Ratio:
        """The ratio of a blend whose request names none (or "auto"): the loading controller's
        choice where it runs, else ``blend_ratio``."""
        return Ratio.AUTO if self.blend_controller else Ratio(self.blend_ratio)
