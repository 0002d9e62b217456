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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote


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
# Route metadata (the same grpc_initial_metadata) for admission (lifecycle/admission.py): a route can
# fix a request's priority class, cap the class its clients may ask for, and set default TTFT and
# TPOT objectives. Values: critical | standard | sheddable (or an integer: > 0 critical, < 0 sheddable).
PRIORITY_METADATA_KEY = "x-llm-priority"
MAX_PRIORITY_METADATA_KEY = "x-llm-max-priority"
TTFT_SLO_METADATA_KEY = "x-llm-ttft-slo-ms"
TPOT_SLO_METADATA_KEY = "x-llm-tpot-slo-ms"
# A route's class objectives over the model's (`admission.objectives`): "critical=2x,standard=10x".
OBJECTIVES_METADATA_KEY = "x-llm-objectives"
# Priority classes by name, as the integers the priority header also accepts (Gateway API Inference
# Extension convention: above 0 critical, 0 standard, below 0 sheddable).
PRIORITY_NAMES: dict[str, int] = {"critical": 1, "standard": 0, "sheddable": -1}
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
# are tokenized on worker threads; a shorter interval gives the GIL back to the event loop sooner
# while they encode (notebook/benchmarks-history.md, "Tokenization on the request path").
GIL_SWITCH_INTERVAL_S = 0.001
# Big request bodies (`bodies:` in the service YAML, lifecycle/bodies.py). orjson holds the GIL while
# it parses, so a multi-megabyte body would stall every other decision (a thread would not help):
# bodies of at least `offload_bytes` are parsed by worker processes, one body each, `workers` at most
# at a time; the rest wait their turn without holding the event loop. Moving a body to a worker and
# its prompt back costs a few copies, more than parsing a small body, so those stay on the loop.
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
# Why this profile: docs/benchmarks.md, "Routing quality: the robustness grid".
# `bounded-load` keeps any engine from holding more than twice its share of the requests in flight,
# whatever the model predicts (the floor under it: docs/tuning.md).
# `slo-ttft`, `slo-tpot` and `decode-speed` act only on requests that carry a TTFT objective
# (x-llm-ttft-slo-ms) or a TPOT objective (x-llm-tpot-slo-ms): for others they change nothing.
# decode-speed's 0.6: notebook/benchmarks-history.md, "Decode speed in placement".
DEFAULT_PROFILE: dict[str, Any] = {
    "filters": ["bounded-load", "slo-ttft", "slo-tpot"],
    "scorers": [{"name": "predicted-ttft", "weight": 1.0}, {"name": "decode-speed", "weight": 0.6}],
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
    ttft_slo: str = "x-llm-ttft-slo-ms"  # the client's time-to-first-token objective (opt-in shedding)
    tpot_slo: str = "x-llm-tpot-slo-ms"  # the client's time-per-output-token objective (opt-in shedding)
    ticket: str = "x-llm-ticket"  # set on routed requests; Envoy's access log echoes it back
    stream: str = "x-llm-stream"  # set on streaming requests: envoy.yaml gives them a header timeout


# -- admission (lifecycle/admission.py, `admission:` in the service YAML) ---------------------------
# A model is saturated when none of its candidates has headroom: per unit of capacity weight, fewer
# than `max_waiting_per_weight` requests queued at the engine (its last snapshot's waiting count plus
# what was sent since) and fewer than `max_inflight_per_weight` of this process's own in-flight
# requests (the only signal without snapshots). At saturation sheddable requests get 429 at once,
# standard ones wait in a fair queue (round robin over tenants) for at most `max_wait_s`, critical
# ones are admitted. `max_wait_s` must stay below Envoy's ext_proc message_timeout (2 s in the
# shipped envoy.yaml): Envoy gives up on a reply that takes longer. A queue that has not been empty
# for `overload_after_s` is overload, not a burst: its newest waiters go first and those older than
# `overload_wait_s` get 429 at once (a first-come queue would only admit requests already late).
DEFAULT_ADMISSION_MAX_WAITING_PER_WEIGHT = 16.0
DEFAULT_ADMISSION_MAX_INFLIGHT_PER_WEIGHT = 256.0
DEFAULT_ADMISSION_MAX_QUEUED = 1024
DEFAULT_ADMISSION_MAX_WAIT_S = 1.5
DEFAULT_ADMISSION_RETRY_AFTER_S = 1
DEFAULT_ADMISSION_OVERLOAD_AFTER_S = 0.5
DEFAULT_ADMISSION_OVERLOAD_WAIT_S: float | None = 0.25
# A request decodes for seconds, so its TPOT is the mean over many of the engine's steps; one interval
# holding a long prefill chunk reads several times the typical step. Admission's TPOT gate and the
# `decode-speed` scorer smooth the reported TPOT over this time constant, seconds: four 0.5 s publish
# intervals (why: notebook/benchmarks-history.md, "TPOT-aware admission").
DEFAULT_TPOT_WINDOW_S = 2.0


@dataclass(slots=True, frozen=True)
class Objective:
    """One class's TTFT objective: `factor` x the request's own unloaded TTFT (its prefill on an idle
    engine: what a "1x" or "4x" in the YAML means), or `seconds`; neither: best effort."""

    factor: float | None = None
    seconds: float | None = None

    def budget(self, unloaded_s: float) -> float | None:
        """Seconds of queueing the class may see beyond its unloaded TTFT (None: best effort)."""
        if self.factor is not None:
            return (self.factor - 1.0) * unloaded_s
        if self.seconds is not None:
            return max(0.0, self.seconds - unloaded_s)
        return None


@dataclass(slots=True, frozen=True)
class ClassObjectives:
    """`admission.objectives`: critical 1x (no queue), standard 4x, sheddable best effort; `models`:
    per model name, its own (each starting from these)."""

    critical: Objective = Objective(factor=1.0)
    standard: Objective = Objective(factor=4.0)
    sheddable: Objective = Objective()
    models: Mapping[str, ClassObjectives] = field(default_factory=dict)

    def for_model(self, model: str | None) -> ClassObjectives:
        return self.models.get(model, self) if model is not None and self.models else self

    def over(self, route: RouteObjectives) -> ClassObjectives:
        """These with a route's own objectives in their place (`x-llm-objectives`)."""
        if not route:
            return self
        own = dict(route)
        return ClassObjectives(
            critical=own.get("critical", self.critical),
            standard=own.get("standard", self.standard),
            sheddable=own.get("sheddable", self.sheddable),
        )


RouteObjectives = tuple[tuple[str, "Objective"], ...]
"""A route's objectives by class name (those it sets; route_objectives())."""


def route_objectives(value: str, where: str) -> RouteObjectives:
    """A route's `x-llm-objectives` metadata: `class=objective` pairs, comma-separated, each class at
    most once, objectives as in `admission.objectives` ("2x", "800ms", "best-effort")."""
    pairs: dict[str, Objective] = {}
    for item in value.split(","):
        name, sep, objective = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in CLASS_NAMES or name in pairs:
            raise ConfigError(
                f"{where}: expected class=objective pairs (classes {', '.join(CLASS_NAMES)}, each once), "
                f"got {item.strip()!r}"
            )
        pairs[name] = objective_value(objective.strip(), f"{where}.{name}")
    return tuple(pairs.items())


def objective_value(value: Any, where: str) -> Objective:
    """`1x`, `4x` (times the unloaded TTFT), a number of seconds, `500ms`, or null (best effort)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("best-effort", "none")):
        return Objective()
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            if text.endswith("x"):
                factor = float(text[:-1])
                if factor >= 1.0 and factor < 1e6:
                    return Objective(factor=factor)
            elif text.endswith("ms"):
                return Objective(seconds=number(float(text[:-2]) / 1000, where, positive=True))
            elif text.endswith("s"):
                return Objective(seconds=number(float(text[:-1]), where, positive=True))
        except ValueError:
            pass
        raise ConfigError(
            f"{where} must be a multiple of the unloaded TTFT ('1x', '4x', >= 1), seconds ('2s', "
            f"'500ms', 0.5) or best-effort, got {value!r}"
        )
    return Objective(seconds=number(value, where, positive=True))


CLASS_NAMES = ("critical", "standard", "sheddable")


def class_objectives(raw: Any, where: str, base: ClassObjectives | None = None) -> ClassObjectives:
    """`objectives:` (or, with `base`, one model's entry under its `models:`, over `base`)."""
    section = mapping(raw, where)
    check_keys(section, CLASS_NAMES if base is not None else (*CLASS_NAMES, "models"), where)
    default = base or ClassObjectives()

    def value(name: str) -> Objective:
        if name in section:
            return objective_value(section[name], f"{where}.{name}")
        return cast(Objective, getattr(default, name))

    top = ClassObjectives(
        critical=value("critical"), standard=value("standard"), sheddable=value("sheddable")
    )
    if base is not None or section.get("models") is None:
        return top
    models = mapping(section["models"], f"{where}.models")
    per_model: dict[str, ClassObjectives] = {}
    for name, entry in models.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.models: model names must be non-empty strings, got {name!r}")
        per_model[name] = class_objectives(entry, f"{where}.models.{name}", top)
    return replace(top, models=per_model)


@dataclass(slots=True, frozen=True)
class AdmissionSettings:
    """`admission:` in the service YAML (see the comment above and docs/tuning.md).

    Off unless `enabled: true`: it turns saturation into 429s, and its in-flight cap counts this
    replica's leases, which leak (until lease_timeout_s) when several replicas run without Redis: a
    rolling restart of such replicas then sheds requests the fleet had room for."""

    enabled: bool = False
    max_waiting_per_weight: float = DEFAULT_ADMISSION_MAX_WAITING_PER_WEIGHT
    max_inflight_per_weight: float = DEFAULT_ADMISSION_MAX_INFLIGHT_PER_WEIGHT
    max_kv_usage: float | None = None
    """A candidate whose engine reports at least this KV-cache usage has no headroom (None: unused)."""
    max_predicted_wait_s: float | None = None
    """A candidate whose predicted prefill queue (the default profile's `predicted-ttft` model,
    seconds) reaches this has no headroom; below it, the headroom is what is left over the mean
    prefill of a request sent there (None: unused)."""
    max_tpot_s: float | None = None
    """A candidate whose engine's time per output token (the snapshots' interval means, smoothed
    over `tpot_window_s`) is at or above this has no headroom: one more sequence there slows every
    running one (None: unused). Only while the model is saturated does it also restrict placement."""
    tpot_window_s: float = DEFAULT_TPOT_WINDOW_S
    max_queued: int = DEFAULT_ADMISSION_MAX_QUEUED
    max_wait_s: float = DEFAULT_ADMISSION_MAX_WAIT_S
    overload_after_s: float = DEFAULT_ADMISSION_OVERLOAD_AFTER_S
    overload_wait_s: float | None = DEFAULT_ADMISSION_OVERLOAD_WAIT_S
    """Once a model's queue has not been empty for `overload_after_s`, its waiters are served newest
    first and those queued longer than this get 429 at once (None: FIFO up to `max_wait_s` always)."""
    retry_after_s: int = DEFAULT_ADMISSION_RETRY_AFTER_S
    objectives: ClassObjectives = field(default_factory=lambda: ClassObjectives())
    """Each class's TTFT objective: lower classes are placed only where a request of a higher class
    would still meet its own (lifecycle/admission.py, "Class objectives")."""
    client_max_priority: int = PRIORITY_NAMES["standard"]
    """The highest class a client's own priority header may ask for on a route whose metadata sets
    no cap (`x-llm-max-priority`): a client cannot make itself critical unless a route grants it.
    Applies whether or not admission is enabled (the class also reaches `engine_priority`)."""


def priority_value(value: Any, where: str) -> int:
    """A priority class in the YAML: critical | standard | sheddable, or an integer."""
    if isinstance(value, str) and value.strip().lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{where} must be one of {', '.join(PRIORITY_NAMES)} or an integer, got {value!r}")


def admission_settings(raw: Any, where: str = "config: 'admission'") -> AdmissionSettings:
    """A validated AdmissionSettings from a YAML mapping (absent: the defaults, admission off)."""
    section = mapping(raw, where)
    check_keys(section, AdmissionSettings.__dataclass_fields__, where)
    values: dict[str, Any] = {}
    if "enabled" in section:
        values["enabled"] = boolean(section["enabled"], f"{where}.enabled")
    for key in (
        "max_waiting_per_weight",
        "max_inflight_per_weight",
        "max_wait_s",
        "tpot_window_s",
        "overload_after_s",
    ):
        if key in section:
            values[key] = number(section[key], f"{where}.{key}", positive=True)
    if section.get("max_predicted_wait_s") is not None:
        values["max_predicted_wait_s"] = number(
            section["max_predicted_wait_s"], f"{where}.max_predicted_wait_s", positive=True
        )
    if "overload_wait_s" in section:
        raw_wait = section["overload_wait_s"]
        values["overload_wait_s"] = (
            None if raw_wait is None else number(raw_wait, f"{where}.overload_wait_s", positive=True)
        )
    if section.get("max_tpot_s") is not None:
        values["max_tpot_s"] = number(section["max_tpot_s"], f"{where}.max_tpot_s", positive=True)
    if section.get("max_kv_usage") is not None:
        values["max_kv_usage"] = number(
            section["max_kv_usage"], f"{where}.max_kv_usage", minimum=0.0, maximum=1.0
        )
    if "max_queued" in section:
        values["max_queued"] = integer(section["max_queued"], f"{where}.max_queued", minimum=0)
    if "retry_after_s" in section:
        values["retry_after_s"] = integer(section["retry_after_s"], f"{where}.retry_after_s", minimum=1)
    if section.get("objectives") is not None:
        values["objectives"] = class_objectives(section["objectives"], f"{where}.objectives")
    if "client_max_priority" in section:
        values["client_max_priority"] = priority_value(
            section["client_max_priority"], f"{where}.client_max_priority"
        )
    return AdmissionSettings(**values)


@dataclass(slots=True, frozen=True)
class EnginePriority:
    """`engine_priority:` in the service YAML: write each request's priority class into its body, as
    the number the engines schedule by, so an engine serves a critical request ahead of its own queue.

    vLLM reads the body's `priority` (lower runs first; only with `--scheduling-policy priority`,
    otherwise a non-zero value is a 400), hence the defaults. For an engine that runs higher values
    first, swap the numbers. The client's own value for the field is overwritten: its class comes
    from the priority header and the route, which it cannot raise past the route's cap."""

    field: str = "priority"
    critical: int = -1
    standard: int = 0
    sheddable: int = 1
    clusters: frozenset[str] | None = None
    """Only requests routed to these clusters are rewritten (None: every cluster): for a pool where
    some engines do not run the priority policy (vLLM answers 400 to a non-zero priority there)."""

    def value(self, priority: int) -> int:
        """The engine's number for a request's priority (the header's integer: > 0 critical)."""
        if priority > 0:
            return self.critical
        return self.sheddable if priority < 0 else self.standard

    def value_for(self, cluster: str, priority: int) -> int | None:
        """`value`, for a request routed to `cluster`; None when `clusters` leaves it out."""
        if self.clusters is not None and cluster not in self.clusters:
            return None
        return self.value(priority)


def engine_priority_settings(raw: Any, where: str = "config: 'engine_priority'") -> EnginePriority | None:
    """None (off) when absent or null; `{}` turns it on with vLLM's numbers."""
    if raw is None:
        return None
    section = mapping(raw, where)
    check_keys(section, EnginePriority.__dataclass_fields__, where)
    values: dict[str, Any] = {}
    if "field" in section:
        name = string(section["field"], f"{where}.field")
        if not name.isidentifier():
            raise ConfigError(f"{where}.field must be a JSON field name like 'priority', not {name!r}")
        values["field"] = name
    for key in ("critical", "standard", "sheddable"):
        if key in section:
            values[key] = integer(section[key], f"{where}.{key}")
    if section.get("clusters") is not None:
        values["clusters"] = frozenset(string_list(section["clusters"], f"{where}.clusters", empty=False))
    return EnginePriority(**values)


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
    """Where the fleet's snapshots live. Key names are derived here so publisher and service agree.

    Topology (docs/fleet-state.md): a plain `redis://` / `rediss://` / `unix://` URL is one server;
    `redis+sentinel://h:p,h:p/<master>/<db>` (or `sentinels:` + `master_name:`) follows the master
    that Sentinel names; `redis+cluster://h:p,h:p` (or `cluster: true`) is a Redis Cluster, where
    every key of the pool carries one hash tag so the pool lives in one slot."""

    url: str = DEFAULT_REDIS_URL
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    pool: str = "default"
    key_prefix: str | None = None
    resync_interval_s: float = 5.0
    # Service only: READY snapshots this many of their own TTLs past expiry still serve a model with no
    # fresh READY instance (STALE_READY_GRACE_TTLS above); 0 turns the grace off.
    stale_ready_grace_ttls: float = STALE_READY_GRACE_TTLS
    sentinels: tuple[str, ...] = ()  # "host:port" of each Sentinel; needs master_name
    master_name: str | None = None
    cluster: bool = False

    @property
    def is_cluster(self) -> bool:
        return self.cluster or self.url.startswith(CLUSTER_SCHEMES)

    @property
    def prefix(self) -> str:
        base = self.key_prefix or f"llm-extproc:{self.pool}"
        if self.is_cluster and "{" not in base:
            return "{" + base + "}"  # one hash slot for the whole pool: MGET and SCAN stay on one node
        return base

    @property
    def channel(self) -> str:
        return f"{self.prefix}:events"

    def key(self, upstream_id: str) -> str:
        return f"{self.prefix}:snap:{upstream_id}"


STANDALONE_SCHEMES = ("redis://", "rediss://", "unix://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


@dataclass(slots=True, frozen=True)
class RedisTopology:
    """What `RedisSettings` points at, parsed once: the client factory and the config checks share it."""

    kind: str  # "standalone" | "sentinel" | "cluster"
    nodes: tuple[tuple[str, int], ...] = ()  # sentinels, or cluster seed nodes
    master_name: str | None = None
    db: int = 0
    tls: bool = False
    username: str | None = None  # from the URL; RedisSettings.username/password take precedence
    password: str | None = None


def redacted_url(url: str) -> str:
    """`url` fit for a log or an error: whatever stands before its last `@` (user name and password)
    is shown as `***`, with or without a scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    _, at, hosts = rest.rpartition("@")  # as redis_topology() reads it: a password may hold a `/`
    return f"{scheme}{sep}***@{hosts}" if at else url


def _host_port(text: str, where: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: {text!r} is not host:port")
    return host.strip("[]"), int(port)


def redis_topology(settings: RedisSettings, where: str = "redis") -> RedisTopology:
    """Parse the URL (and the sentinels/master_name/cluster keys) into a topology; ConfigError if bad."""
    url = settings.url
    scheme, sep, rest = url.partition("://")
    if not sep:  # never echoed as written: `user:secret@host:6379` would put the password in a log
        raise ConfigError(
            f"{where}: 'url' {redacted_url(url)!r} has no scheme (e.g. redis://, rediss://, "
            "redis+sentinel://, redis+cluster://)"
        )
    tls = scheme.startswith("rediss")
    userinfo, at, hostpart = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    hosts, _, path = hostpart.partition("/")
    parts = [p for p in path.split("/") if p]
    if settings.sentinels or url.startswith(SENTINEL_SCHEMES):
        if settings.sentinels:
            nodes = tuple(_host_port(s, f"{where}.sentinels") for s in settings.sentinels)
            master = settings.master_name
            db = int(parts[-1]) if parts and parts[-1].isdigit() and not url.startswith("unix") else 0
        else:
            nodes = tuple(_host_port(h, f"{where}.url") for h in hosts.split(",") if h)
            master = settings.master_name or (parts[0] if parts else None)
            db = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        if not nodes:
            raise ConfigError(f"{where}: Sentinel needs at least one host:port")
        if not master:
            raise ConfigError(
                f"{where}: Sentinel needs a master name (redis+sentinel://h:p,h:p/<master>/<db> "
                "or 'master_name')"
            )
        return RedisTopology("sentinel", nodes, master, db, tls, username, password)
    if settings.is_cluster:
        if url.startswith("unix://"):
            raise ConfigError(f"{where}: a Redis Cluster needs host:port seed nodes, not a unix socket")
        nodes = tuple(_host_port(h, f"{where}.url") for h in hosts.split(",") if h)
        if not nodes:
            raise ConfigError(f"{where}: a Redis Cluster needs at least one seed host:port")
        if parts and parts[0] not in ("0",):
            raise ConfigError(f"{where}: a Redis Cluster has only database 0")
        return RedisTopology("cluster", nodes, None, 0, tls, username, password)
    if not url.startswith(STANDALONE_SCHEMES):
        raise ConfigError(
            f"{where}: 'url' must be a redis://, rediss://, unix://, redis+sentinel:// or "
            "redis+cluster:// URL"
        )
    return RedisTopology("standalone", tls=tls, username=username, password=password)


def redis_settings(raw: Any, where: str, password_env: str | None = None) -> RedisSettings:
    """A validated RedisSettings from a YAML mapping; the password falls back to `password_env`."""
    raw = mapping(raw, where)
    check_keys(raw, RedisSettings.__dataclass_fields__, where)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "resync_interval_s":
            values[key] = number(value, f"{where}.{key}", positive=True)
        elif key == "stale_ready_grace_ttls":
            values[key] = number(value, f"{where}.{key}", minimum=0.0, maximum=100.0)
        elif key == "sentinels":
            values[key] = tuple(string_list(value, f"{where}.{key}"))
        elif key == "cluster":
            values[key] = boolean(value, f"{where}.{key}")
        elif key in ("password", "username") and value is not None and not isinstance(value, str):
            # Not echoed (a numeric password is still a password); YAML turns `12345` into a number
            # (and `0123` into 83): only a quoted string is taken as written.
            raise ConfigError(
                f"{where}.{key} must be a string: quote it in the YAML ({key}: '...'); "
                f"got a {type(value).__name__} (not shown)"
            )
        elif value is not None:
            values[key] = string(value, f"{where}.{key}")
    settings = RedisSettings(**values)
    if settings.sentinels and settings.is_cluster:
        raise ConfigError(f"{where}: choose Sentinel or Cluster, not both")
    redis_topology(settings, where)
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


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


def string(value: Any, where: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def string_list(value: Any, where: str, *, empty: bool = True) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (not empty and not value):
        raise ConfigError(f"{where} must be a {'' if empty else 'non-empty '}list of strings")
    return value


@dataclass(slots=True, frozen=True)
class TlsSettings:
    """`tls:` in the service YAML: the gRPC port (ext_proc, access log, health) speaks TLS with this
    certificate; with `client_ca_file`, every client must present a certificate that CA signed
    (mTLS: only Envoy, holding one, can open streams). Files are read again when they change
    (a rotated Kubernetes Secret), checked at the next connection."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None


def tls_settings(
    raw: Any, base_dir: str | os.PathLike[str] | None, where: str = "config: 'tls'"
) -> TlsSettings:
    """A validated TlsSettings: each file named must exist and hold PEM (relative names resolve
    against the config file's folder)."""
    section = mapping(raw, where)
    check_keys(section, TlsSettings.__dataclass_fields__, where)
    files: dict[str, Path] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        if section.get(key) is None:
            if key != "client_ca_file":
                raise ConfigError(f"{where}.{key} is required")
            continue
        path = Path(string(section[key], f"{where}.{key}"))
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        try:
            head = path.read_bytes()[:4096]
        except OSError as exc:
            raise ConfigError(f"{where}.{key}: cannot read {path}: {exc.strerror}") from None
        if b"-----BEGIN " not in head:
            raise ConfigError(f"{where}.{key}: {path} is not a PEM file")
        files[key] = path
    return TlsSettings(**files)


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
