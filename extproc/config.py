"""Service configuration: one YAML file (plus a few CLI overrides) turned into the running objects.

Per-route tuning belongs in envoy.yaml; this file supplies the defaults and the pool. The schema (the
settings records, their declared checks and defaults) lives in `extproc.settings`; here the sections
are assembled, with the pool, the profiles and the tokenizers that other layers parse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.fleet import Pool, RoutingMode, pool_from_config
from extproc.fleet.pool import CLUSTER_KEYS
from extproc.scheduling import Profile, profile_from_config
from extproc.scheduling.framework import ENTRY_KEYS, SCORER_ENTRY_KEYS
from extproc.settings import (
    CLASS_NAMES,
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
    ENV_REDIS_SENTINEL_PASSWORD,
    MAX_SHUTDOWN_ANNOUNCE_S,
    RELEASE_MODES,
    REQUIRED,
    AdmissionSettings,
    BodySettings,
    Check,
    ConfigError,
    DiscoverySettings,
    EnginePriority,
    ExplainSettings,
    HeaderNames,
    KubernetesDiscovery,
    RedisSettings,
    SyncSettings,
    TlsSettings,
    admission_settings,
    check_keys,
    checks,
    defaults,
    discovery_settings,
    engine_priority_settings,
    explain_settings,
    mapping,
    redis_settings,
    section,
    setting,
    sync_settings,
    tls_settings,
    yaml_keys,
)
from extproc.tokenization import TokenizerRegistry
from extproc.tokenization import from_config as tokenizers_from_config
from extproc.tokenization.config import TOKENIZER_KEYS


@dataclass(slots=True)
class ServiceConfig:
    pool: Pool
    profile: Profile
    """The default profile; routes may select another from `profiles` (see PROFILE_METADATA_KEY)."""
    profiles: dict[str, Profile] = field(default_factory=dict)
    listen: str = setting(DEFAULT_LISTEN, Check("listen"))
    metrics_listen: str | None = setting(DEFAULT_METRICS_LISTEN, Check("listen", nullable=True))
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, Check("integer", minimum=1))
    grpc_max_message_bytes: int = setting(0, Check("integer", minimum=0))
    shutdown_grace_s: float = setting(DEFAULT_SHUTDOWN_GRACE_S, Check("number", minimum=0))
    shutdown_announce_s: float = setting(
        DEFAULT_SHUTDOWN_ANNOUNCE_S, Check("number", minimum=0, maximum=MAX_SHUTDOWN_ANNOUNCE_S)
    )
    """On SIGTERM: NOT_SERVING but still accepting streams this long, before the drain (settings)."""
    release_on: str = setting(DEFAULT_RELEASE_ON, Check("choice", choices=RELEASE_MODES))
    """How a routed request's end is learnt: `stream_end` or `access_log` (see settings)."""
    tls: TlsSettings | None = None
    """TLS, and with a client CA mTLS, on the gRPC port (`tls:`; settings.TlsSettings)."""
    lease_timeout_s: float = setting(DEFAULT_LEASE_TIMEOUT_S, Check("number", minimum=1))
    headers: HeaderNames = field(default_factory=HeaderNames)
    endpoint_metadata_namespace: str = setting(DEFAULT_ENDPOINT_METADATA_NAMESPACE, Check("string"))
    fallbacks: int = setting(0, Check("integer", minimum=0))
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
    """The top level's plain settings (ServiceConfig's declared fields), each checked."""
    scalars = checks(ServiceConfig)
    return {k: scalars[k].read(v, f"config: '{k}'") for k, v in raw.items() if k in scalars}


_SCALAR_KEYS = tuple(checks(ServiceConfig))


ANY = "*"  # service_keys(): a name the user chooses (a profile, a model), or a list's entries


def service_keys() -> dict[str, Any]:
    """Every key of the service YAML, as a tree (a section maps to its keys; a leaf is None; `ANY`
    stands for names the user chooses and for a list's entries), built from the very key sets the
    parsers accept: the one list docs/configuration.md is checked against
    (tests/test_config_reference.py) and `check-config --keys` prints."""

    def keys(names: Any) -> dict[str, Any]:
        return dict.fromkeys(names)

    objectives = keys(CLASS_NAMES)
    admission = keys(yaml_keys(AdmissionSettings))
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
        "headers": keys(yaml_keys(HeaderNames)),
        "fleet": keys(yaml_keys(RedisSettings)),
        "tokenizers": {ANY: keys(TOKENIZER_KEYS)},
        "bodies": keys(yaml_keys(BodySettings)),
        "sync": keys(yaml_keys(SyncSettings)),
        "explain": keys(yaml_keys(ExplainSettings)),
        "admission": admission,
        "engine_priority": keys(yaml_keys(EnginePriority)),
        "discovery": {"kubernetes": keys(yaml_keys(KubernetesDiscovery))},
        "tls": keys(yaml_keys(TlsSettings)),
    }


# The service YAML's sections read by their settings record's declarations ("": the top level).
DECLARED_SECTIONS: dict[str, type] = {
    "": ServiceConfig,
    "headers": HeaderNames,
    "fleet": RedisSettings,
    "bodies": BodySettings,
    "sync": SyncSettings,
    "explain": ExplainSettings,
    "admission": AdmissionSettings,
    "engine_priority": EnginePriority,
    "discovery.kubernetes": KubernetesDiscovery,
}
ROUTING = Check("choice", choices=tuple(m.value for m in RoutingMode))


def service_schema() -> dict[str, tuple[Check, Any]]:
    """Each key of the service YAML that a declaration checks, by dotted path: its Check and its
    default (`REQUIRED` where it has none). The keys it leaves out (pool, profiles, tokenizers, tls
    files, objectives, computed defaults) are read by their own parsers."""
    schema: dict[str, tuple[Check, Any]] = {"routing": (ROUTING, RoutingMode.CLUSTER.value)}
    for prefix, record in DECLARED_SECTIONS.items():
        given = defaults(record)
        for name, check in checks(record).items():
            schema[f"{prefix}.{name}" if prefix else name] = (check, given.get(name, REQUIRED))
    return schema


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
    mode = RoutingMode(ROUTING.read(raw.get("routing", RoutingMode.CLUSTER.value), "config: 'routing'"))
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

    headers = section(HeaderNames, raw.get("headers"), "config: 'headers'")
    fleet = None
    if raw.get("fleet") is not None:
        fleet = redis_settings(
            raw["fleet"],
            "config: 'fleet'",
            password_env=ENV_REDIS_PASSWORD,
            sentinel_password_env=ENV_REDIS_SENTINEL_PASSWORD,
        )
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
        bodies=section(BodySettings, raw.get("bodies"), "config: 'bodies'"),
        sync=sync_settings(raw.get("sync"), base_dir),
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
