"""The gateway's configuration: dataclasses, filled from the command line and
an optional YAML file (the file holds what does not fit on a command line:
API keys with their limits and priority classes)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

ROUTING_POLICIES = ("round-robin", "least-load", "prefix", "kv-aware", "session")


@dataclass
class BreakerConfig:
    """Per replica: ``failure_threshold`` consecutive failures (errors or
    timeouts of requests or probes) open the breaker; after ``cooldown_s`` the
    next probe is the half-open trial that closes or re-opens it."""

    failure_threshold: int = 3
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"breaker.failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"breaker.cooldown_s must be >= 0, got {self.cooldown_s}")


@dataclass
class CacheConfig:
    """Response cache of deterministic requests (temperature 0 or a seed)."""

    enabled: bool = True
    max_entries: int = 1024
    max_bytes: int = 64 * 2**20
    ttl_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache.{name} must be >= 1, got {getattr(self, name)}")
        if self.ttl_s <= 0:
            raise ValueError(f"cache.ttl_s must be > 0, got {self.ttl_s}")


@dataclass
class KeyConfig:
    """One API key: its limits (None: unlimited) and priority class, which
    becomes the engine's ``priority`` field (lower runs first)."""

    key: str
    rpm: Optional[int] = None
    tpm: Optional[int] = None
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("keys[].key must not be empty")
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"keys[{self.key[:4]}...].{name} must be >= 1, got {value}")


@dataclass
class GatewayConfig:
    replicas: list[str] = field(default_factory=list)
    # A DNS name resolved every discovery_interval_s; each address is a replica
    # (a Kubernetes headless service lists one address per pod).
    discovery_dns: Optional[str] = None
    discovery_port: int = 8000
    discovery_interval_s: float = 5.0
    host: str = "127.0.0.1"
    port: int = 8080
    routing: str = "least-load"
    # Model folder whose tokenizer kv-aware routing uses (the replicas' model).
    tokenizer: Optional[str] = None
    # ZMQ endpoints of the replicas' --kv-events-endpoint, by replica URL.
    kv_events: dict[str, str] = field(default_factory=dict)
    block_size: int = 16
    # kv-aware: the replica with the longest cached prefix is skipped when its
    # load exceeds the least loaded replica's by more than this many requests.
    max_imbalance: int = 4
    # prefix policy: bytes of prompt text per hashed chunk.
    prefix_chunk_bytes: int = 256
    session_header: str = "x-session-id"
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    max_connections: int = 1000
    # Larger request bodies get 413 (a replica's own --max-body-size default).
    max_body_bytes: int = 8 * 2**20
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    redis_url: Optional[str] = None
    keys: list[KeyConfig] = field(default_factory=list)
    # Without keys the gateway is open; with keys, every /v1 request needs one.
    admin_key: Optional[str] = None
    upstream_api_key: Optional[str] = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}; got {self.routing!r}")
        if self.routing == "kv-aware" and not self.tokenizer:
            raise ValueError("routing kv-aware needs tokenizer (the replicas' model folder)")
        for name in ("block_size", "prefix_chunk_bytes", "max_connections", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        for name in ("probe_interval_s", "probe_timeout_s", "request_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        seen = set()
        for k in self.keys:
            if k.key in seen:
                raise ValueError("keys: a key is listed twice")
            seen.add(k.key)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    """A dataclass from a YAML mapping; unknown keys are errors (typos must not pass silently)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where + '.' if where else ''}{unknown[0]}: unknown setting")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        default = known[name].default_factory() if callable(known[name].default_factory) else known[name].default
        if is_dataclass(default):
            value = _build(type(default), value, f"{where}.{name}" if where else name)
        elif name == "keys":
            if not isinstance(value, list):
                raise ValueError("keys: expected a list")
            value = [_build(KeyConfig, v, f"keys[{i}]") for i, v in enumerate(value)]
        kwargs[name] = value
    return cls(**kwargs)


def load_config(path: Optional[str | Path], overrides: dict[str, Any]) -> GatewayConfig:
    """The YAML file (if any) with the command line's settings on top."""
    data: dict[str, Any] = {}
    if path is not None:
        import yaml  # only with a config file

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ValueError(f"--config: cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"--config: {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping")
    for name, value in overrides.items():
        if name == "replicas":
            data["replicas"] = list(data.get("replicas", [])) + list(value)
        else:
            data[name] = value
    return _build(GatewayConfig, data, "")
