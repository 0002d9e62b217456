"""Service configuration: one YAML file, a few CLI/env overrides.

Per-route tuning belongs in envoy.yaml; this file supplies the defaults and the pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.fleet import Pool, RoutingMode, pool_from_config
from extproc.fleet.redis_feed import RedisSettings
from extproc.scheduling import DEFAULT_PROFILE, Profile, profile_from_config

ENV_CONFIG = "LLM_EXTPROC_CONFIG"
# gRPC initial metadata key naming the scheduling profile for a route; set it in envoy.yaml with
# ExtProcPerRoute.overrides.grpc_initial_metadata.
PROFILE_METADATA_KEY = "x-llm-profile"
ENV_REDIS_PASSWORD = "LLM_EXTPROC_REDIS_PASSWORD"
# Above the 32 MiB Envoy buffer limit in envoy/envoy.yaml; raise both together.
DEFAULT_GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class HeaderNames:
    destination_cluster: str = "x-llm-destination-cluster"
    destination_endpoint: str = "x-gateway-destination-endpoint"
    session: str = "x-session-id"
    user: str = "x-user-id"
    priority: str = "x-llm-priority"


@dataclass(slots=True)
class ServiceConfig:
    pool: Pool
    profile: Profile
    """The default profile; routes may select another from `profiles` (see PROFILE_METADATA_KEY)."""
    profiles: dict[str, Profile] = field(default_factory=dict)
    listen: str = "127.0.0.1:9002"
    metrics_listen: str | None = "127.0.0.1:9090"
    max_body_bytes: int = 16 * 1024 * 1024
    grpc_max_message_bytes: int = 0
    shutdown_grace_s: float = 30.0
    headers: HeaderNames = field(default_factory=HeaderNames)
    endpoint_metadata_namespace: str = "envoy.lb"
    fleet: RedisSettings | None = None
    """Live fleet state from Redis; None keeps the static pool with the service's own counts."""

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        # Envoy sends a whole buffered body in one gRPC message, up to *its* buffer limit, which may
        # exceed max_body_bytes: a receive limit below that turns an oversized body into a gRPC
        # RESOURCE_EXHAUSTED (a 5xx at the client) instead of our JSON 413.
        floor = max(self.max_body_bytes, DEFAULT_GRPC_MAX_MESSAGE_BYTES) + 1024 * 1024
        if self.grpc_max_message_bytes < floor:
            self.grpc_max_message_bytes = floor


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ServiceConfig:
    """Read the YAML file (or $LLM_EXTPROC_CONFIG), then apply non-None keyword overrides."""
    chosen = path or os.environ.get(ENV_CONFIG)
    if not chosen:
        raise ValueError(f"no configuration file: pass --config or set {ENV_CONFIG}")
    text = Path(chosen).read_text()
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{chosen}: top level must be a mapping")
    return config_from_dict(raw, **overrides)


# Scalar settings and their accepted types (bool is rejected where a number is expected).
_SCALARS: dict[str, tuple[type, ...]] = {
    "listen": (str,),
    "metrics_listen": (str, type(None)),
    "max_body_bytes": (int,),
    "grpc_max_message_bytes": (int,),
    "shutdown_grace_s": (int, float),
    "endpoint_metadata_namespace": (str,),
}


def config_from_dict(raw: dict[str, Any], **overrides: Any) -> ServiceConfig:
    """Build and validate a config; every malformed input raises ValueError naming the key."""
    raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
    unknown = set(raw) - set(_SCALARS) - {"routing", "pool", "scheduling", "headers", "fleet"}
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}")
    for key, types in _SCALARS.items():
        if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], types)):
            raise ValueError(f"config: '{key}' has the wrong type ({type(raw[key]).__name__})")
    try:
        mode = RoutingMode(raw.get("routing", RoutingMode.CLUSTER.value))
    except ValueError:
        raise ValueError(f"config: 'routing' must be one of {[m.value for m in RoutingMode]}") from None
    pool_raw = raw.get("pool")
    if not isinstance(pool_raw, dict) or not isinstance(pool_raw.get("clusters"), list):
        raise ValueError("config: 'pool.clusters' is required and must be a list")
    pool = pool_from_config(pool_raw["clusters"], mode)

    sched = raw.get("scheduling") or {}
    if not isinstance(sched, dict):
        raise ValueError("config: 'scheduling' must be a mapping")
    profiles = sched.get("profiles") or {"default": DEFAULT_PROFILE}
    if not isinstance(profiles, dict):
        raise ValueError("config: 'scheduling.profiles' must be a mapping of name -> profile")
    chosen = sched.get("profile", "default")
    if chosen not in profiles:
        raise ValueError(f"config: scheduling profile '{chosen}' is not defined")
    built = {name: profile_from_config(name, spec) for name, spec in profiles.items()}

    headers_raw = raw.get("headers") or {}
    if not isinstance(headers_raw, dict):
        raise ValueError("config: 'headers' must be a mapping")
    allowed = set(HeaderNames.__dataclass_fields__)
    for key, value in headers_raw.items():
        if key not in allowed:
            raise ValueError(f"config: unknown header setting '{key}' (known: {sorted(allowed)})")
        if not isinstance(value, str) or not value:
            raise ValueError(f"config: header name for '{key}' must be a non-empty string")
    headers = HeaderNames(**{k: v.lower() for k, v in headers_raw.items()})
    return ServiceConfig(
        fleet=_fleet(raw.get("fleet")),
        pool=pool,
        profile=built[chosen],
        profiles=built,
        headers=headers,
        **{k: raw[k] for k in _SCALARS if k in raw},
    )


def _fleet(raw: Any) -> RedisSettings | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("config: 'fleet' must be a mapping")
    allowed = set(RedisSettings.__dataclass_fields__)
    unknown = set(raw) - allowed
    if unknown:
        raise ValueError(f"config: unknown fleet keys {sorted(unknown)} (known: {sorted(allowed)})")
    for key, value in raw.items():
        if key == "resync_interval_s":
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError("config: 'fleet.resync_interval_s' must be a positive number")
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"config: 'fleet.{key}' must be a string")
    settings = RedisSettings(**raw)
    if not settings.url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("config: 'fleet.url' must be a redis://, rediss:// or unix:// URL")
    if settings.password is None:
        settings.password = os.environ.get(ENV_REDIS_PASSWORD) or None
    return settings
