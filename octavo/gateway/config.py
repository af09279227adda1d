"""The gateway's configuration: dataclasses, filled from the command line and
an optional YAML file (octavo/entrypoints/config_file.py; the file also holds
what does not fit on a command line: API keys with their limits and priority
classes)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, Optional

from octavo.config import option, section
from octavo.gateway.replica_url import normalize_url

ROUTING_POLICIES = ("round-robin", "least-load", "prefix", "kv-aware", "session")


@dataclass
class BreakerConfig:
    """Per replica: ``failure_threshold`` consecutive failures (errors or
    timeouts of requests or probes) open the breaker; after ``cooldown_s`` the
    next probe is the half-open trial that closes or re-opens it."""

    failure_threshold: int = option(3, "consecutive failures of a replica that open its circuit breaker")
    cooldown_s: float = option(5.0, "seconds an open breaker waits before the probe that may close it",
                               unit="seconds")

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"breaker.failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"breaker.cooldown_s must be >= 0, got {self.cooldown_s}")


@dataclass
class CacheConfig:
    """Response cache of deterministic requests (temperature 0 or a seed)."""

    enabled: bool = option(True, "cache the responses of deterministic requests (temperature 0 or a seed)",
                           aliases=("--cache",))
    max_entries: int = option(1024, "most responses cached")
    max_bytes: int = option(64 * 2**20, "most bytes of responses cached", unit="bytes")
    ttl_s: float = option(300.0, "seconds a cached response is served", unit="seconds")

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache.{name} must be >= 1, got {getattr(self, name)}")
        if self.ttl_s <= 0:
            raise ValueError(f"cache.ttl_s must be > 0, got {self.ttl_s}")


@dataclass
class KeyConfig:
    """One API key: its limits (None: unlimited) and priority class, which
    becomes the engine's ``priority`` field (lower runs first); keys naming
    the same ``tenant`` share cached responses (by default each key has its own)."""

    key: str
    rpm: Optional[int] = None
    tpm: Optional[int] = None
    priority: int = 0
    tenant: Optional[str] = None

    @property
    def digest(self) -> str:
        # Keys are secrets: what is named after one (buckets, cache entries; maybe in a shared Redis) uses this.
        return hashlib.sha256(self.key.encode()).hexdigest()[:32]

    @property
    def cache_scope(self) -> str:
        """Whose cached responses a request of this key may be answered with."""
        return f"tenant:{self.tenant}" if self.tenant is not None else f"key:{self.digest}"

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("keys[].key must not be empty")
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant):
            raise ValueError(f"keys[{self.key[:4]}...].tenant must be a non-empty string")
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"keys[{self.key[:4]}...].{name} must be >= 1, got {value}")


@dataclass
class GatewayConfig:
    replicas: list[str] = option([], "a replica's URL; repeat for several (the command line adds to the config "
                                     "file's list)", aliases=("--replica",), repeatable=True, add_to_file=True,
                                 metavar="URL")
    # A DNS name resolved every discovery_interval_s; each address is a replica
    # (a Kubernetes headless service lists one address per pod).
    discovery_dns: Optional[str] = option(None, "a DNS name whose addresses are replicas")
    discovery_port: int = option(8000, "the replicas' port at the discovered addresses")
    discovery_interval_s: float = option(5.0, "seconds between DNS lookups", unit="seconds")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8080, "port to listen on")
    routing: str = option("least-load", "how a replica is chosen for a request", choices=ROUTING_POLICIES)
    tokenizer: Optional[str] = option(None, "the replicas' model folder (kv-aware routing tokenizes with it)")
    kv_events: dict[str, str] = option({}, "a replica's --kv-events-endpoint, e.g. "
                                           "http://10.0.0.5:8000=tcp://10.0.0.5:5557; repeat for several",
                                       repeatable=True, metavar="URL=ENDPOINT")
    block_size: int = option(16, "the replicas' KV cache block size (kv-aware routing hashes blocks of it)",
                             unit="tokens")
    max_imbalance: int = option(4, "kv-aware/prefix/session give way to least-load beyond this many queued "
                                   "requests")
    prefix_chunk_bytes: int = option(256, "prefix routing: bytes of prompt text per hashed chunk", unit="bytes")
    session_header: str = option("x-session-id", "session routing: the request header naming the session")
    probe_interval_s: float = option(1.0, "seconds between health probes of each replica", unit="seconds")
    probe_timeout_s: float = option(2.0, "seconds a health probe may take", unit="seconds")
    request_timeout_s: float = option(600.0, "seconds a proxied request may take", unit="seconds")
    connect_timeout_s: float = option(2.0, "seconds to connect to a replica", unit="seconds")
    max_connections: int = option(1000, "most open connections to the replicas")
    max_body_bytes: int = option(8 * 2**20, "larger request bodies get 413 (a replica's own --max-body-size "
                                            "default)", unit="bytes")
    max_header_bytes: int = option(64 * 2**10, "a request line and headers larger than this get 431",
                                   unit="bytes")
    body_timeout_s: float = option(30.0, "seconds a request body may take to arrive; slower uploads get 408",
                                   unit="seconds")
    breaker: BreakerConfig = section(BreakerConfig, prefixed=True)
    cache: CacheConfig = section(CacheConfig, prefixed=True)
    redis_url: Optional[str] = option(None, "share the response cache and rate limits through Redis")
    # Without keys the gateway is open; with keys, every /v1 request needs one.
    keys: list[KeyConfig] = option([], "API keys with their limits and priority classes (config file only)",
                                   cli=False)
    admin_key: Optional[str] = option(None, "bearer key of the admin API (default: $OCTAVO_GATEWAY_ADMIN_KEY; "
                                            "unset or empty: the admin API is off)")
    upstream_api_key: Optional[str] = option(None, "bearer key sent to the replicas")
    log_level: str = option("info", "log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}; got {self.routing!r}")
        if self.routing == "kv-aware" and not self.tokenizer:
            raise ValueError("routing kv-aware needs tokenizer (the replicas' model folder)")
        for name in ("block_size", "prefix_chunk_bytes", "max_connections", "max_body_bytes", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        for name in ("probe_interval_s", "probe_timeout_s", "request_timeout_s", "connect_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.replicas = [_checked_url(url, f"replicas[{i}]") for i, url in enumerate(self.replicas)]
        self.kv_events = {_checked_url(url, "kv_events"): endpoint for url, endpoint in self.kv_events.items()}
        if self.admin_key is not None and not self.admin_key.strip():
            # An empty secret would let `Authorization: Bearer ` in: it means no admin API at all.
            self.admin_key = None
        self.keys = [_key_config(k, i) for i, k in enumerate(self.keys)]
        seen = set()
        for k in self.keys:
            if k.key in seen:
                raise ValueError("keys: a key is listed twice")
            seen.add(k.key)


def _checked_url(url: str, name: str) -> str:
    try:
        return normalize_url(url)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _key_config(value: Any, index: int) -> KeyConfig:
    """A ``keys`` entry: a KeyConfig, or its mapping from the config file (unknown keys are errors: typos must
    not pass silently)."""
    if isinstance(value, KeyConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"keys[{index}]: expected a mapping")
    unknown = sorted(set(value) - {f.name for f in fields(KeyConfig)})
    if unknown:
        raise ValueError(f"keys[{index}].{unknown[0]}: unknown setting")
    return KeyConfig(**value)
