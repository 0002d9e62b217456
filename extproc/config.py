"""Service configuration: one YAML file (plus a few CLI overrides) turned into the running objects.

Per-route tuning belongs in envoy.yaml; this file supplies the defaults and the pool. The defaults
themselves and the value checks live in `extproc.settings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.discovery.settings import DiscoverySettings, KubernetesDiscovery, discovery_settings
from extproc.fleet import Pool, RoutingMode, pool_from_config
from extproc.fleet.pool import CLUSTER_KEYS
from extproc.scheduling import Profile, profile_from_config
from extproc.scheduling.explain import EXPLAIN_KEYS, ExplainSettings, explain_settings
from extproc.scheduling.framework import ENTRY_KEYS, SCORER_ENTRY_KEYS
from extproc.settings import (
    CLASS_NAMES,
    DEFAULT_BODY_OFFLOAD_BYTES,
    DEFAULT_BODY_TRIM_INTERVAL_S,
    DEFAULT_BODY_WORKER_NICE,
    DEFAULT_BODY_WORKERS,
    DEFAULT_ENDPOINT_METADATA_NAMESPACE,
    DEFAULT_GRPC_MAX_MESSAGE_BYTES,
    DEFAULT_LEASE_TIMEOUT_S,
    DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_PROFILE,
    DEFAULT_RELEASE_ON,
    DEFAULT_SHUTDOWN_ANNOUNCE_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    ENV_CONFIG,
    ENV_REDIS_PASSWORD,
    MAX_SHUTDOWN_ANNOUNCE_S,
    RELEASE_MODES,
    AdmissionSettings,
    ConfigError,
    EnginePriority,
    HeaderNames,
    RedisSettings,
    TlsSettings,
    admission_settings,
    boolean,
    check_keys,
    engine_priority_settings,
    integer,
    listen_address,
    mapping,
    number,
    redis_settings,
    string,
    tls_settings,
)
from extproc.tokenization import TokenizerRegistry
from extproc.tokenization import from_config as tokenizers_from_config
from extproc.tokenization.config import TOKENIZER_KEYS


@dataclass(slots=True, frozen=True)
class BodySettings:
    """How request bodies are parsed (`bodies:` in the YAML; see settings and lifecycle/bodies.py)."""

    offload_bytes: int = DEFAULT_BODY_OFFLOAD_BYTES
    """Bodies at least this big are parsed in a worker process, smaller ones on the event loop."""
    workers: int = DEFAULT_BODY_WORKERS
    """Worker processes, started as big bodies need them: also the most big bodies parsed at once
    (the others wait their turn, never holding the event loop)."""
    trim_interval_s: float = DEFAULT_BODY_TRIM_INTERVAL_S
    """Hand freed memory back to the OS this long after big bodies stop; 0: never (glibc defaults)."""
    worker_nice: int = DEFAULT_BODY_WORKER_NICE
    """CPU niceness of the workers (0-19): big bodies yield CPU to the event loop."""


def _bodies(raw: Any) -> BodySettings:
    where = "config: 'bodies'"
    section = mapping(raw, where)
    check_keys(section, BodySettings.__dataclass_fields__, where)
    values: dict[str, Any] = {}
    for key in ("offload_bytes", "workers"):
        if key in section:
            values[key] = integer(section[key], f"{where}.{key}", minimum=1)
    if "worker_nice" in section:
        nice = integer(section["worker_nice"], f"{where}.worker_nice", minimum=0)
        if nice > 19:
            raise ConfigError(f"{where}.worker_nice must be an integer from 0 to 19, got {nice}")
        values["worker_nice"] = nice
    if "trim_interval_s" in section:
        values["trim_interval_s"] = number(section["trim_interval_s"], f"{where}.trim_interval_s", minimum=0)
    return BodySettings(**values)


@dataclass(slots=True, frozen=True)
class SyncSettings:
    """Replicas sharing their decisions through the fleet's Redis (`sync:`; server/sync.py,
    docs/fleet-state.md "Shared state between replicas")."""

    enabled: bool = True
    """On by default whenever `fleet:` configures Redis; without Redis there is nothing to share."""
    interval_s: float = 0.02
    """How often this replica publishes its decisions (when it has any)."""
    heartbeat_s: float = 0.5
    """The longest silence: an idle replica still publishes its in-flight counts this often."""
    expire_s: float = 3.0
    """Another replica's counts (and pinned cache blocks) are dropped after this long without a word."""
    max_message_bytes: int = 512 * 1024
    max_updates_per_s: int = 20_000
    """Beyond these, updates are dropped (counted) and peers release what this replica pinned."""
    state_interval_s: float = 5.0
    """How often the learnt state is written to Redis for a replica that starts late."""
    key_file: str | None = None
    """A file holding the replicas' shared HMAC key (else $LLM_EXTPROC_SYNC_KEY; never the key in
    the YAML): messages and state dumps are signed, unsigned or forged ones dropped (server/sync.py)."""


def _sync(raw: Any, base_dir: str | os.PathLike[str] | None = None) -> SyncSettings:
    where = "config: 'sync'"
    section = mapping(raw, where)
    check_keys(section, SyncSettings.__dataclass_fields__, where)
    values: dict[str, Any] = {}
    if "enabled" in section:
        values["enabled"] = boolean(section["enabled"], f"{where}.enabled")
    for key in ("interval_s", "heartbeat_s", "expire_s", "state_interval_s"):
        if key in section:
            values[key] = number(section[key], f"{where}.{key}", positive=True)
    for key in ("max_message_bytes", "max_updates_per_s"):
        if key in section:
            values[key] = integer(section[key], f"{where}.{key}", minimum=1)
    if section.get("key_file") is not None:  # relative: to the config file's folder
        values["key_file"] = str(Path(base_dir or ".") / string(section["key_file"], f"{where}.key_file"))
    settings = SyncSettings(**values)
    if settings.expire_s <= settings.heartbeat_s:
        raise ConfigError(f"{where}.expire_s must exceed heartbeat_s (a live replica would expire)")
    return settings


@dataclass(slots=True)
class ServiceConfig:
    pool: Pool
    profile: Profile
    """The default profile; routes may select another from `profiles` (see PROFILE_METADATA_KEY)."""
    profiles: dict[str, Profile] = field(default_factory=dict)
    listen: str = DEFAULT_LISTEN
    metrics_listen: str | None = DEFAULT_METRICS_LISTEN
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    grpc_max_message_bytes: int = 0
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    shutdown_announce_s: float = DEFAULT_SHUTDOWN_ANNOUNCE_S
    """On SIGTERM: NOT_SERVING but still accepting streams this long, before the drain (settings)."""
    release_on: str = DEFAULT_RELEASE_ON
    tls: TlsSettings | None = None
    """TLS, and with a client CA mTLS, on the gRPC port (`tls:`; settings.TlsSettings)."""
    """How a routed request's end is learnt: `stream_end` or `access_log` (see settings)."""
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    headers: HeaderNames = field(default_factory=HeaderNames)
    endpoint_metadata_namespace: str = DEFAULT_ENDPOINT_METADATA_NAMESPACE
    fallbacks: int = 0
    """Endpoint mode: next-best endpoints listed after the pick, for the proxy's retries (0: none)."""
    discovery: DiscoverySettings | None = None
    """Endpoints learnt at run time (`discovery:`, extproc.discovery); None: the YAML's list only."""
    fleet: RedisSettings | None = None
    """Live fleet state from Redis; None keeps the static pool with the service's own counts."""
    tokenizers: TokenizerRegistry | None = None
    """Per-model tokenizers (`tokenizers:` in the YAML); None: plugins estimate ~4 bytes per token."""
    bodies: BodySettings = field(default_factory=BodySettings)
    sync: SyncSettings = field(default_factory=SyncSettings)
    """Replica sync through the fleet's Redis (used only when `fleet` is set)."""
    explain: ExplainSettings = field(default_factory=ExplainSettings)
    """Decision explanation (`explain:`): the x-llm-decision header and /debug/decisions; off by default."""
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    """Priorities, shedding and the fair admission queue (`admission:`; lifecycle/admission.py)."""
    engine_priority: EnginePriority | None = None
    """Each request's class written into its body for the engines' own scheduler (`engine_priority:`);
    None: the body is forwarded untouched."""

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ConfigError("max_body_bytes must be positive")
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
        raise ConfigError(f"no configuration file: pass --config or set {ENV_CONFIG}")
    text = Path(chosen).read_text()
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{chosen}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{chosen}: top level must be a mapping")
    return config_from_dict(raw, base_dir=Path(chosen).parent, **overrides)


_SECTIONS = (
    "routing",
    "pool",
    "scheduling",
    "headers",
    "fleet",
    "tokenizers",
    "bodies",
    "sync",
    "explain",
    "admission",
    "engine_priority",
    "discovery",
    "tls",
)


def _scalars(raw: dict[str, Any]) -> dict[str, Any]:
    """The plain settings, each checked for type and range."""
    out: dict[str, Any] = {}
    if "listen" in raw:
        out["listen"] = listen_address(raw["listen"], "config: 'listen'")
    if "metrics_listen" in raw:
        value = raw["metrics_listen"]
        out["metrics_listen"] = None if value is None else listen_address(value, "config: 'metrics_listen'")
    if "max_body_bytes" in raw:
        out["max_body_bytes"] = integer(raw["max_body_bytes"], "config: 'max_body_bytes'", minimum=1)
    if "grpc_max_message_bytes" in raw:
        out["grpc_max_message_bytes"] = integer(
            raw["grpc_max_message_bytes"], "config: 'grpc_max_message_bytes'", minimum=0
        )
    if "shutdown_grace_s" in raw:
        out["shutdown_grace_s"] = number(raw["shutdown_grace_s"], "config: 'shutdown_grace_s'", minimum=0)
    if "shutdown_announce_s" in raw:
        out["shutdown_announce_s"] = number(
            raw["shutdown_announce_s"],
            "config: 'shutdown_announce_s'",
            minimum=0,
            maximum=MAX_SHUTDOWN_ANNOUNCE_S,
        )
    if "release_on" in raw:
        value = string(raw["release_on"], "config: 'release_on'")
        if value not in RELEASE_MODES:
            raise ConfigError(f"config: 'release_on' must be one of {list(RELEASE_MODES)}, not {value!r}")
        out["release_on"] = value
    if "lease_timeout_s" in raw:
        out["lease_timeout_s"] = number(raw["lease_timeout_s"], "config: 'lease_timeout_s'", minimum=1)
    if "endpoint_metadata_namespace" in raw:
        out["endpoint_metadata_namespace"] = string(
            raw["endpoint_metadata_namespace"], "config: 'endpoint_metadata_namespace'"
        )
    if "fallbacks" in raw:
        out["fallbacks"] = integer(raw["fallbacks"], "config: 'fallbacks'", minimum=0)
    return out


_SCALAR_KEYS = (
    "listen",
    "metrics_listen",
    "max_body_bytes",
    "grpc_max_message_bytes",
    "shutdown_grace_s",
    "shutdown_announce_s",
    "release_on",
    "lease_timeout_s",
    "endpoint_metadata_namespace",
    "fallbacks",
)


ANY = "*"  # service_keys(): a name the user chooses (a profile, a model), or a list's entries


def service_keys() -> dict[str, Any]:
    """Every key of the service YAML, as a tree (a section maps to its keys; a leaf is None; `ANY`
    stands for names the user chooses and for a list's entries), built from the very key sets the
    parsers accept: the one list docs/configuration.md is checked against
    (tests/test_config_reference.py) and `check-config --keys` prints."""

    def keys(names: Any) -> dict[str, Any]:
        return dict.fromkeys(names)

    objectives = keys(CLASS_NAMES)
    admission = keys(AdmissionSettings.__dataclass_fields__)
    admission["objectives"] = {**objectives, "models": {ANY: objectives}}
    profile = {
        "filters": {ANY: keys(ENTRY_KEYS)},
        "scorers": {ANY: keys(SCORER_ENTRY_KEYS)},
        "picker": keys(ENTRY_KEYS),
    }
    return {
        **keys(_SCALAR_KEYS),
        "routing": None,
        "pool": {"clusters": {ANY: keys(CLUSTER_KEYS)}},
        "scheduling": {"profile": None, "profiles": {ANY: profile}},
        "headers": keys(HeaderNames.__dataclass_fields__),
        "fleet": keys(RedisSettings.__dataclass_fields__),
        "tokenizers": {ANY: keys(TOKENIZER_KEYS)},
        "bodies": keys(BodySettings.__dataclass_fields__),
        "sync": keys(SyncSettings.__dataclass_fields__),
        "explain": keys(EXPLAIN_KEYS),
        "admission": admission,
        "engine_priority": keys(EnginePriority.__dataclass_fields__),
        "discovery": {"kubernetes": keys(KubernetesDiscovery.__dataclass_fields__)},
        "tls": keys(TlsSettings.__dataclass_fields__),
    }


def key_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted path of every key in a service_keys()-style tree, sections included."""
    paths = []
    for name, sub in tree.items():
        path = f"{prefix}{name}"
        paths.append(path)
        if isinstance(sub, dict):
            paths += key_paths(sub, f"{path}.")
    return paths


def _admission(raw: Any, profile: Profile) -> AdmissionSettings:
    """`admission:`; its predicted-wait signal reads the default profile's model of the prefill
    queues, so a profile without one is refused rather than the setting silently doing nothing."""
    settings = admission_settings(raw)
    if settings.max_predicted_wait_s is not None and profile.prefill_queue is None:
        raise ConfigError(
            "config: 'admission.max_predicted_wait_s' needs a model of the prefill queues (the "
            f"'predicted-ttft' scorer) in the default profile '{profile.name}'"
        )
    return settings


def config_from_dict(
    raw: dict[str, Any], *, base_dir: str | os.PathLike[str] | None = None, **overrides: Any
) -> ServiceConfig:
    """Build and validate a config; every malformed input raises ConfigError naming the key.
    Relative file names (tokenizer files) resolve against `base_dir`, the config file's folder."""
    raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
    check_keys(raw, (*_SCALAR_KEYS, *_SECTIONS), "config")
    scalars = _scalars(raw)
    try:
        mode = RoutingMode(raw.get("routing", RoutingMode.CLUSTER.value))
    except ValueError:
        raise ConfigError(f"config: 'routing' must be one of {[m.value for m in RoutingMode]}") from None
    pool_raw = mapping(raw.get("pool"), "config: 'pool'")
    check_keys(pool_raw, ("clusters",), "config: 'pool'")
    if not isinstance(pool_raw.get("clusters"), list):
        raise ConfigError("config: 'pool.clusters' is required and must be a list")
    discovery = discovery_settings(raw.get("discovery"))
    discovered = discovery.clusters() if discovery is not None else ()
    names = {c.get("name") for c in pool_raw["clusters"] if isinstance(c, dict)}
    for name in discovered:
        if mode is not RoutingMode.ENDPOINT:
            raise ConfigError("config: 'discovery' fills endpoints: it needs 'routing: endpoint'")
        if name not in names:
            raise ConfigError(f"config: discovery cluster '{name}' is not in 'pool.clusters'")
    pool = pool_from_config(pool_raw["clusters"], mode, discovered)
    if scalars.get("fallbacks", 0) > 0 and mode is not RoutingMode.ENDPOINT:
        raise ConfigError("config: 'fallbacks' needs 'routing: endpoint' (it lists endpoints)")

    sched = mapping(raw.get("scheduling"), "config: 'scheduling'")
    check_keys(sched, ("profile", "profiles"), "config: 'scheduling'")
    profiles = sched.get("profiles") or {"default": DEFAULT_PROFILE}
    if not isinstance(profiles, dict):
        raise ConfigError("config: 'scheduling.profiles' must be a mapping of name -> profile")
    chosen = sched.get("profile", "default")
    if chosen not in profiles:
        raise ConfigError(f"config: scheduling profile '{chosen}' is not defined")
    built = {name: profile_from_config(name, spec) for name, spec in profiles.items()}

    headers_raw = mapping(raw.get("headers"), "config: 'headers'")
    check_keys(headers_raw, HeaderNames.__dataclass_fields__, "config: 'headers'")
    headers = HeaderNames(
        **{k: string(v, f"config: header name for '{k}'").lower() for k, v in headers_raw.items()}
    )
    fleet = None
    if raw.get("fleet") is not None:
        fleet = redis_settings(raw["fleet"], "config: 'fleet'", password_env=ENV_REDIS_PASSWORD)
    tokenizers = None
    if raw.get("tokenizers") is not None:
        try:
            tokenizers = tokenizers_from_config(
                mapping(raw["tokenizers"], "config: 'tokenizers'"), base_dir=base_dir
            )
        except ConfigError:
            raise
        except (ValueError, OSError) as exc:
            raise ConfigError(f"config: {exc}") from None
    engine_priority = engine_priority_settings(raw.get("engine_priority"))
    if engine_priority is not None and engine_priority.clusters is not None:
        unknown = sorted(engine_priority.clusters - set(pool.cluster_names()))
        if unknown:
            raise ConfigError(f"config: 'engine_priority.clusters' names clusters not in the pool: {unknown}")
    tls = None if raw.get("tls") is None else tls_settings(raw["tls"], base_dir)
    return ServiceConfig(
        tls=tls,
        discovery=discovery,
        bodies=_bodies(raw.get("bodies")),
        sync=_sync(raw.get("sync"), base_dir),
        explain=explain_settings(raw.get("explain")),
        admission=_admission(raw.get("admission"), built[chosen]),
        engine_priority=engine_priority,
        tokenizers=tokenizers,
        fleet=fleet,
        pool=pool,
        profile=built[chosen],
        profiles=built,
        headers=headers,
        **scalars,
    )
