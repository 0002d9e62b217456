"""The publisher's configuration: which instances to scrape (from its YAML or Envoy's admin API),
how often, and the limits on what it reads; validated at load (ConfigError naming the key)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.fleet.gpus import MAX_GPU_NAME
from extproc.fleet.pool import parse_endpoint
from extproc.fleet.snapshots import MAX_QUEUE
from extproc.publishers.engines import (
    ENGINE_METRICS,
)
from extproc.publishers.kv_events import KvEventsSpec, kv_events_spec
from extproc.settings import (
    CHECK,
    DEFAULT_DISCOVERY_INTERVAL_S,
    DEFAULT_PUBLISH_INTERVAL_S,
    DEFAULT_SCRAPE_TIMEOUT_S,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_SENTINEL_PASSWORD,
    MAX_METRICS_BYTES,
    MAX_TTL_MS,
    MIN_TTL_MS,
    SCRAPE_TIMEOUT_SHARE,
    Check,
    ConfigError,
    RedisSettings,
    mapping,
    redis_settings,
    section,
    setting,
    setting_from,
    yaml_keys,
)

# Largest /metrics (or DCGM) page read, by default. A vLLM page is ~100-300 KB; the cap leaves room
# for far bigger pages, while a much larger one would cost seconds of a core to parse and could let
# one engine's page outlast the snapshots' TTL. Configurable up to
# MAX_METRICS_BYTES (`max_metrics_bytes`); a page above the cap is a failed scrape, read no further.
DEFAULT_MAX_METRICS_BYTES = 2 * 1024 * 1024


MIN_METRICS_BYTES = 4096


@dataclass(slots=True)
class InstanceSpec:
    """One engine instance to scrape (an entry of `instances:`, or a host Envoy's admin API names)."""

    cluster: str = field(metadata={CHECK: Check("string")})
    # ip:port ([v6]:port), checked by instance_from_dict
    address: str = field(metadata={CHECK: Check("string")})
    engine: str = setting("vllm", Check("choice", choices=tuple(ENGINE_METRICS)))
    models: tuple[str, ...] = setting((), Check("strings", empty=True))
    capacity_weight: float = setting(1.0, Check("number", positive=True))
    draining: bool = setting(False, Check("boolean"))
    # "" (or null): the engine's own default, e.g. /prometheus/metrics for trtllm-serve
    metrics_path: str = setting("", Check("string", empty=True, nullable=True))
    health_path: str = setting("/health", Check("string"))
    # An NVIDIA DCGM exporter that sees this instance's GPUs (e.g. "http://{host}:9400/metrics";
    # {host} is the instance's IP), and which of its GPUs are this instance's (`gpu` indices or UUIDs;
    # empty: all of them). "" : no GPU figures beyond what the engine itself publishes.
    dcgm_url: str = ""
    dcgm_gpus: tuple[str, ...] = ()
    # The GPU's name, e.g. "NVIDIA H100 80GB HBM3" or "A10G" (published as gpu_model: the service's
    # prefill-speed prior until the rate is measured, fleet/gpus.py). "": DCGM's modelName, if any.
    gpu: str = ""
    # The most requests the engine runs at once (vLLM's --max-num-seqs, SGLang's
    # --max-running-requests), published as max_num_seqs: the service's batch limit from the first
    # snapshot on. None: the engine's own figure where it publishes one, else learnt from its queues.
    max_num_seqs: int | None = None
    # The engine's KV-cache events (vLLM/SGLang ZMQ PUB): subscribed, mapped to the service's prefix
    # index blocks and published to Redis (publishers/kv_events.py). None: no events.
    kv_events: KvEventsSpec | None = None

    def __post_init__(self) -> None:
        if not self.metrics_path:
            row = ENGINE_METRICS.get(self.engine)
            self.metrics_path = row.metrics_path if row is not None else "/metrics"

    @property
    def upstream_id(self) -> str:
        return f"{self.cluster}/{self.address}"

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    def dcgm(self) -> str:
        """The DCGM exporter's URL with {host} filled in ("" when none is configured)."""
        host = self.address.rpartition(":")[0]
        return self.dcgm_url.replace("{host}", host)


@dataclass(slots=True)
class PublisherConfig:
    """The publisher's YAML (docs/fleet-state.md). Timing bounds: readers reject snapshots whose TTL
    is out of range, so a bad value fails here, not silently there."""

    redis: RedisSettings
    instances: list[InstanceSpec] = field(default_factory=list)
    envoy_admin: str | None = setting(None, Check("string", nullable=True))
    interval_s: float = setting(DEFAULT_PUBLISH_INTERVAL_S, Check("number", minimum=0.01, maximum=3600.0))
    ttl_s: float | None = setting(
        None, Check("number", minimum=MIN_TTL_MS / 1000, maximum=MAX_TTL_MS / 1000, nullable=True)
    )
    discovery_interval_s: float = setting(
        DEFAULT_DISCOVERY_INTERVAL_S, Check("number", minimum=0.1, maximum=86400.0)
    )
    # None: derived from the interval (scrape_deadline_s)
    scrape_timeout_s: float | None = setting(
        None, Check("number", minimum=0.005, maximum=600.0, nullable=True)
    )
    # the publisher's own /metrics; None: off
    metrics_listen: str | None = setting(None, Check("listen", nullable=True))
    # larger /metrics pages are failed scrapes; checked by check(), which the Publisher also runs on
    # configs built in code
    max_metrics_bytes: int = DEFAULT_MAX_METRICS_BYTES
    publisher_id: str = setting_from(lambda: f"{socket.gethostname()}-{os.getpid()}", Check("string"))

    @property
    def ttl_ms(self) -> int:
        return int((self.ttl_s if self.ttl_s is not None else max(3 * self.interval_s, 2.0)) * 1000)

    @property
    def scrape_deadline_s(self) -> float:
        """One instance's whole scrape (health + metrics + parsing) must end within this: inside one
        interval."""
        if self.scrape_timeout_s is not None:
            return self.scrape_timeout_s
        return min(DEFAULT_SCRAPE_TIMEOUT_S, SCRAPE_TIMEOUT_SHARE * self.interval_s)

    def check(self) -> None:
        """A scrape that may outlast the interval would make every snapshot of that instance late; a
        page cap beyond MAX_METRICS_BYTES would let one engine's page cost seconds of parsing."""
        cap = self.max_metrics_bytes
        if (
            isinstance(cap, bool)
            or not isinstance(cap, int)
            or not MIN_METRICS_BYTES <= cap <= MAX_METRICS_BYTES
        ):
            raise ConfigError(
                f"publisher: 'max_metrics_bytes' must be an integer number of bytes from "
                f"{MIN_METRICS_BYTES} to {MAX_METRICS_BYTES}, got {cap!r} "
                f"(default {DEFAULT_MAX_METRICS_BYTES}: 2 MiB)"
            )
        if self.scrape_timeout_s is not None and self.scrape_timeout_s >= self.interval_s:
            raise ConfigError(
                f"publisher: 'scrape_timeout_s' ({self.scrape_timeout_s:g}) must be below 'interval_s' "
                f"({self.interval_s:g}); leave it unset for min({DEFAULT_SCRAPE_TIMEOUT_S:g} s, "
                f"{SCRAPE_TIMEOUT_SHARE:g} x interval)"
            )


def instance_from_dict(raw: dict[str, Any]) -> InstanceSpec:
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("cluster"), str)
        or not isinstance(raw.get("address"), str)
    ):
        raise ConfigError("publisher: each instance needs string 'cluster' and 'address' (ip:port)")
    where = f"publisher: instance {raw['address']}"
    try:
        parse_endpoint(raw["address"])
    except ValueError as exc:
        raise ConfigError(f"publisher: {exc}") from None
    engine = raw.get("engine", "vllm")
    if engine not in ENGINE_METRICS:
        raise ConfigError(f"publisher: unknown engine '{engine}' (known: {sorted(ENGINE_METRICS)})")
    dcgm_url, dcgm_gpus = _dcgm_settings(raw)
    gpu = raw.get("gpu", "")
    if not isinstance(gpu, str) or len(gpu) > MAX_GPU_NAME or not gpu.isprintable():
        raise ConfigError(f"publisher: 'gpu' must be a GPU name of at most {MAX_GPU_NAME} characters")
    return section(
        InstanceSpec,
        raw,
        where,
        dcgm_url=dcgm_url,
        dcgm_gpus=dcgm_gpus,
        gpu=gpu,
        max_num_seqs=_max_num_seqs(raw),
        kv_events=kv_events_spec(raw.get("kv_events"), where),
    )


def _max_num_seqs(raw: dict[str, Any]) -> int | None:
    value = raw.get("max_num_seqs")
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # Envoy's metadata numbers are doubles
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUEUE:
        raise ConfigError(
            f"publisher: instance {raw['address']}: 'max_num_seqs' must be an integer from 1 to "
            f"{MAX_QUEUE} (the engine's --max-num-seqs), got {value!r}"
        )
    return value


def _dcgm_settings(raw: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """`dcgm_url` (http(s)://..., "{host}" allowed) and `dcgm_gpus` (GPU indices or UUIDs)."""
    where = f"publisher: instance {raw['address']}"
    url = raw.get("dcgm_url") or ""
    if not isinstance(url, str) or (url and not url.startswith(("http://", "https://"))):
        raise ConfigError(f"{where}: 'dcgm_url' must be an http:// or https:// URL")
    gpus = raw.get("dcgm_gpus", [])
    if not isinstance(gpus, list) or not all(
        isinstance(g, str | int) and not isinstance(g, bool) for g in gpus
    ):
        raise ConfigError(f"{where}: 'dcgm_gpus' must be a list of GPU indices or UUIDs")
    return url, tuple(str(g) for g in gpus)


# What only the service's fleet feed reads (how often it resyncs, how long stale snapshots serve).
SERVICE_ONLY_REDIS_KEYS = ("resync_interval_s", "stale_ready_grace_ttls")


def publisher_keys() -> dict[str, Any]:
    """Every key of the publisher YAML as a tree (as config.service_keys(); "*" stands for the
    entries of `instances`), from the key sets the parser accepts: what docs/fleet-state.md is
    checked against."""
    top = dict.fromkeys(set(yaml_keys(PublisherConfig)) - {"redis", "instances"})
    instance: dict[str, Any] = dict.fromkeys(yaml_keys(InstanceSpec))
    instance["kv_events"] = dict.fromkeys(KvEventsSpec.__dataclass_fields__)
    return {
        **dict(sorted(top.items())),
        "redis": dict.fromkeys(
            k for k in RedisSettings.__dataclass_fields__ if k not in SERVICE_ONLY_REDIS_KEYS
        ),
        "instances": {"*": instance},
    }


def load_publisher_config(path: str | None, **overrides: Any) -> PublisherConfig:
    raw: dict[str, Any] = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    flags = {k: v for k, v in overrides.items() if v is not None}
    redis_raw = dict(mapping(raw.pop("redis", None), "publisher: 'redis'"))
    for key in ("url", "pool", "key_prefix", "username", "password"):  # the command line's --redis-*
        if f"redis_{key}" in flags:
            redis_raw[key] = flags.pop(f"redis_{key}")
    raw.update(flags)
    for key in SERVICE_ONLY_REDIS_KEYS:
        if key in redis_raw:
            raise ConfigError(
                f"publisher: 'redis.{key}' is the service's (its fleet: section), not the publisher's"
            )
    redis = redis_settings(
        redis_raw,
        "publisher: 'redis'",
        password_env=ENV_REDIS_PASSWORD,
        sentinel_password_env=ENV_REDIS_SENTINEL_PASSWORD,
    )
    instances = [instance_from_dict(i) for i in raw.pop("instances", []) or []]
    given: dict[str, Any] = {"redis": redis, "instances": instances}
    if "max_metrics_bytes" in raw:
        given["max_metrics_bytes"] = raw["max_metrics_bytes"]  # checked by cfg.check() below
    cfg = section(PublisherConfig, raw, "publisher", **given)
    if not cfg.instances and not cfg.envoy_admin:
        raise ConfigError("publisher: give 'instances' or 'envoy_admin' (Envoy admin URL for discovery)")
    cfg.check()
    return cfg
