"""Every default the service and the publisher start from, the settings records, and the checks that
turn a YAML value into a setting (or a ConfigError that names the key).

The bottom layer: it imports nothing from the rest of the package and nothing that talks to the
network, so any layer (and a tool that only validates files) can read it.
"""

from __future__ import annotations

import importlib.resources
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what is wanted."""


# -- shipped configuration files ------------------------------------------------------------------
def shipped_configs() -> Path:
    """The folder of example configs that ships inside the package (the repository's envoy/ folder):
    Envoy configs and service YAMLs that agree, for `llm-extproc init`, the demo and the tests."""
    return Path(str(importlib.resources.files("extproc") / "configs"))


# -- service ---------------------------------------------------------------------------------------
ENV_CONFIG = "LLM_EXTPROC_CONFIG"
ENV_REDIS_PASSWORD = "LLM_EXTPROC_REDIS_PASSWORD"
# gRPC initial metadata key naming the scheduling profile for a route; set it in envoy.yaml with
# ExtProcPerRoute.overrides.grpc_initial_metadata.
PROFILE_METADATA_KEY = "x-llm-profile"
DEFAULT_LISTEN = "127.0.0.1:9002"
DEFAULT_METRICS_LISTEN = "127.0.0.1:9090"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Above the 32 MiB Envoy buffer limit in envoy/envoy.yaml; raise both together.
DEFAULT_GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 30.0
# Shutdown runs in phases (server/app.py, docs/operations.md "Restarts and replica failure"):
#   1. announce: gRPC health says NOT_SERVING, new streams are still accepted, for
#      `shutdown_announce_s`, so Envoy's active health check moves new streams to other replicas;
#   2. drain: no new streams; open ones get up to `shutdown_grace_s` to finish;
#   3. cancel: whatever is still open is cancelled, the process exits 0.
# The announce period must outlast Envoy's detection: `unhealthy_threshold` failed checks `interval`
# apart, the last one possibly waiting its `timeout`, plus a margin for the checker's own scheduling.
# These mirror the `llm-extproc` cluster's health check in the shipped envoy/*.yaml (tests check they
# agree); with another health check, set `shutdown_announce_s` from the same formula.
ENVOY_EXTPROC_HC_INTERVAL_S = 2.0
ENVOY_EXTPROC_HC_TIMEOUT_S = 1.0
ENVOY_EXTPROC_HC_UNHEALTHY_THRESHOLD = 2
SHUTDOWN_ANNOUNCE_MARGIN_S = 1.0
DEFAULT_SHUTDOWN_ANNOUNCE_S = (
    ENVOY_EXTPROC_HC_INTERVAL_S * ENVOY_EXTPROC_HC_UNHEALTHY_THRESHOLD
    + ENVOY_EXTPROC_HC_TIMEOUT_S
    + SHUTDOWN_ANNOUNCE_MARGIN_S
)  # 6 s
MAX_SHUTDOWN_ANNOUNCE_S = 300.0  # above this a value is a unit mistake (ms for s), not a choice
# How the service learns that a routed request ended (server/completions.py): `access_log` ends the
# ext_proc stream right after routing (the service closes it) and reads Envoy's gRPC access log (the
# shipped envoy.yaml), so no response depends on the service; `stream_end` keeps the stream open for
# the whole response (Envoy response_trailer_mode SEND) and needs no access log.
RELEASE_MODES = ("access_log", "stream_end")
DEFAULT_RELEASE_ON = "access_log"
# A routed request whose access-log entry never came is released after this long (no generation
# should last longer; Envoy's stream idle timeout in the shipped envoy.yaml is 300 s).
DEFAULT_LEASE_TIMEOUT_S = 900.0
DEFAULT_ENDPOINT_METADATA_NAMESPACE = "envoy.lb"
# How long a thread may hold the GIL before another gets it (Python's default is 5 ms). Long prompts
# are tokenized on worker threads; at 5 ms the event loop waited up to ~9 ms for the GIL back while
# 200 KB prompts were encoded, at 1 ms ~5.5 ms (`llm-extproc bench-tokenization`).
GIL_SWITCH_INTERVAL_S = 0.001
# Big request bodies (`bodies:` in the service YAML, lifecycle/bodies.py). orjson parses a 15 MB body
# in ~30 ms holding the GIL (a thread would not help), so bodies of at least `offload_bytes` are
# parsed by worker processes, one body each, `workers` at most at a time; the rest wait their turn
# without holding the event loop. Moving a body to a worker and its prompt back costs a few copies,
# more than parsing a small body, so those stay on the loop.
DEFAULT_BODY_OFFLOAD_BYTES = 1024 * 1024
DEFAULT_BODY_WORKERS = 2
# Workers run at this CPU niceness: when CPUs are short, a burst of big bodies slows down rather than
# taking CPU from the event loop that answers every other request.
DEFAULT_BODY_WORKER_NICE = 10
# A worker that has not answered within this long is killed (its body gets a 503): a parse takes
# well under a second, and Envoy's ext_proc message timeout (2 s in envoy/envoy.yaml) has long fired.
BODY_PARSE_DEADLINE_S = 30.0
# After big bodies, memory the allocator keeps is handed back to the OS (glibc malloc_trim, on a
# thread), at most once per this many seconds and once more after the last big body.
DEFAULT_BODY_TRIM_INTERVAL_S = 2.0

# Used when the config defines no profile: the predicted time to first token on each candidate, from a
# model of its prefix cache bounded by its KV capacity and a prefill queue (docs/tuning.md). No global
# KV-usage cut-off: a busy engine that holds the prompt's prefix is often still the best place for it.
# Chosen in the discrete-event mode over the robustness grid (docs/benchmarks.md).
DEFAULT_PROFILE: dict[str, Any] = {
    "scorers": [{"name": "predicted-ttft", "weight": 1.0}],
    "picker": "max-score",
}
# The profile before predicted-ttft (text-block prefix affinity, bounded by queue length, plus load
# scorers and the KV-usage cut-off), kept to compare against and for profiles that want it.
AFFINITY_V1_PROFILE: dict[str, Any] = {
    "filters": ["saturation"],
    "scorers": [
        {"name": "prefix-affinity", "weight": 3.0},
        {"name": "queue-depth", "weight": 1.0},
        {"name": "kv-cache-usage", "weight": 0.5},
        {"name": "least-outstanding", "weight": 0.5},
    ],
    "picker": "max-score",
}
# Used for a model whose snapshots are all stale (or absent while a fleet view is configured).
FALLBACK_PROFILE: dict[str, Any] = {"picker": "weighted-round-robin"}


@dataclass(slots=True)
class HeaderNames:
    destination_cluster: str = "x-llm-destination-cluster"
    destination_endpoint: str = "x-gateway-destination-endpoint"
    session: str = "x-session-id"
    user: str = "x-user-id"
    priority: str = "x-llm-priority"
    ticket: str = "x-llm-ticket"  # set on routed requests; Envoy's access log echoes it back
    stream: str = "x-llm-stream"  # set on streaming requests: envoy.yaml gives them a header timeout


# -- fleet state (Redis feed and view) -------------------------------------------------------------
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REBUILD_EVERY_S = 0.05  # coalesce bursts of snapshots into one rebuild of the derived tables
EXPIRY_TICK_S = 0.25  # rebuild at least this often so expiry is noticed without new data
FORGET_AFTER_S = 300.0  # expired instances are forgotten after this long (their metrics series too)
# A READY snapshot that expired less than this many of its own TTLs ago is still a candidate, but only
# for a model with no fresh READY instance (a late publisher must not turn one DOWN neighbour into 503s
# for everyone); counted in llm_extproc_stale_ready_decisions_total. 0 turns it off.
STALE_READY_GRACE_TTLS = 1.0
REDIS_SOCKET_TIMEOUT_S = 5.0
REDIS_CONNECT_TIMEOUT_S = 2.0


@dataclass(slots=True)
class RedisSettings:
    """Where the fleet's snapshots live. Key names are derived here so publisher and service agree."""

    url: str = DEFAULT_REDIS_URL
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    pool: str = "default"
    key_prefix: str | None = None
    resync_interval_s: float = 5.0

    @property
    def prefix(self) -> str:
        return self.key_prefix or f"llm-extproc:{self.pool}"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:events"

    def key(self, upstream_id: str) -> str:
        return f"{self.prefix}:snap:{upstream_id}"


def redis_settings(raw: Any, where: str, password_env: str | None = None) -> RedisSettings:
    """A validated RedisSettings from a YAML mapping; the password falls back to `password_env`."""
    raw = mapping(raw, where)
    check_keys(raw, RedisSettings.__dataclass_fields__, where)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "resync_interval_s":
            values[key] = number(value, f"{where}.{key}", positive=True)
        elif value is not None:
            values[key] = string(value, f"{where}.{key}")
    settings = RedisSettings(**values)
    if not settings.url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{where}: 'url' must be a redis://, rediss:// or unix:// URL")
    if settings.password is None and password_env is not None:
        settings.password = os.environ.get(password_env) or None
    return settings


# -- publisher -------------------------------------------------------------------------------------
DEFAULT_PUBLISH_INTERVAL_S = 1.0
DEFAULT_DISCOVERY_INTERVAL_S = 10.0
DEFAULT_SCRAPE_TIMEOUT_S = 2.0
# Each instance is scraped and published on its own schedule; its scrape (health + metrics) must end
# well inside one interval. Unset, the timeout is min(DEFAULT_SCRAPE_TIMEOUT_S, share x interval); a
# configured one must be below the interval.
SCRAPE_TIMEOUT_SHARE = 0.8
# Bound on one Redis write (SET + PUBLISH) of one snapshot; a hung Redis must not hold a task longer.
PUBLISH_WRITE_TIMEOUT_S = 2.0
DISCOVERY_TIMEOUT_S = 5.0  # one Envoy admin discovery round (config_dump + clusters)
# Largest /metrics body read (a vLLM scrape is ~100-300 KB); beyond it the scrape is a metrics error.
MAX_METRICS_BYTES = 16 * 1024 * 1024
MAX_HEALTH_BYTES = 64 * 1024
MIN_TTL_MS = 100  # readers reject snapshots whose TTL is outside these bounds
MAX_TTL_MS = 3_600_000


# -- value checks ----------------------------------------------------------------------------------
def mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def check_keys(raw: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Unknown keys are named as such (a typo such as `modles:` must not read as a missing key)."""
    allowed = set(known)
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (known: {sorted(allowed)})")


def number(
    value: Any,
    where: str,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """A real number (bool is refused: YAML's `yes` is not 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{where} must be a positive number, got {value!r}")
    if maximum is not None and minimum is not None and not minimum <= value <= maximum:
        raise ConfigError(f"{where} must be a number from {minimum:g} to {maximum:g}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be a number >= {minimum:g}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be a number <= {maximum:g}, got {value!r}")
    return float(value)


def integer(value: Any, where: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{where} must be {wanted}, got {value!r}")
    return value


def string(value: Any, where: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def string_list(value: Any, where: str, *, empty: bool = True) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (not empty and not value):
        raise ConfigError(f"{where} must be a {'' if empty else 'non-empty '}list of strings")
    return value


def listen_address(value: Any, where: str) -> str:
    """`host:port` for a listening socket: an IP literal ([v6] bracketed; 0.0.0.0 or [::] for every
    interface) or a host name; port 0..65535 (0: any free port). Checked here so `check-config` catches
    it rather than the server failing at start."""
    text = string(value, where)
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where} must be host:port with a port 0-65535, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"{where}: {host} is not an IPv6 address") from None
        return text
    if not _hostname(host):
        raise ConfigError(f"{where}: {host!r} is neither an IP address nor a host name")
    return text


def _hostname(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    if host.replace(".", "").isdigit():  # 300.1.1.1: a malformed IPv4, not a name
        return False
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(
        0 < len(label) <= 63 and label.replace("-", "").isalnum() and not label.startswith("-")
        for label in labels
    )
