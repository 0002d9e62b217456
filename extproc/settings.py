"""The configuration schema: every default the service and the publisher start from, the settings
records of the YAML sections (each key's check declared on its field), and the checks that turn a
YAML value into a setting (or a ConfigError that names the key).

The bottom layer: it imports nothing from the rest of the package and nothing that talks to the
network, so any layer (and a tool that only validates files) can read it.
"""

from __future__ import annotations

import importlib.resources
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast
from urllib.parse import unquote


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what is wanted."""


# -- the schema ------------------------------------------------------------------------------------
# The settings records below are the schema of the YAML files: each field a user sets declares how
# its value is checked (`setting(default, Check(...))`), and `section()` reads a YAML mapping into a
# record by those declarations. The key tree that `check-config --keys` prints and that the docs are
# checked against, and the defaults the docs show, come from the same fields (config.service_keys,
# config.service_schema). A field without a Check is read by its section's own parser: a file that
# must exist, a nested mapping, a default computed at start-up. A setting without a default is
# `field(metadata={CHECK: ...})` (spelt out so that type checkers see it has none): the section names
# it when missing.
CHECK = "check"
REQUIRED = "(required)"  # the default shown for a setting that has none
R = TypeVar("R")
CheckKind = Literal["number", "integer", "boolean", "string", "strings", "choice", "listen", "header"]


@dataclass(slots=True, frozen=True)
class Check:
    """How one YAML value becomes a setting: a kind of the vocabulary below, its bounds, and whether
    null is accepted (as None: the setting unset)."""

    kind: CheckKind
    positive: bool = False
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    choices: tuple[Any, ...] = ()
    aliases: tuple[tuple[Any, Any], ...] = ()
    """YAML values read as another (`explain.header: true` is `on_request`)."""
    empty: bool = False
    """`string`: "" accepted; `strings`: an empty list accepted."""

    def read(self, value: Any, where: str) -> Any:
        for alias, meant in self.aliases:
            if value is alias or (type(value) is type(alias) and value == alias):
                value = meant
                break
        if value is None and self.nullable:
            return None
        kind = self.kind
        if kind == "number":
            return number(value, where, positive=self.positive, minimum=self.minimum, maximum=self.maximum)
        if kind == "integer":
            low = None if self.minimum is None else int(self.minimum)
            high = None if self.maximum is None else int(self.maximum)
            return integer(value, where, minimum=low, maximum=high)
        if kind == "boolean":
            return boolean(value, where)
        if kind == "string":
            return string(value, where, empty=self.empty)
        if kind == "header":
            return string(value, where).lower()
        if kind == "strings":
            return tuple(string_list(value, where, empty=self.empty))
        if kind == "listen":
            return listen_address(value, where)
        if kind == "choice":
            if value not in self.choices or isinstance(value, bool):
                raise ConfigError(f"{where} must be one of {list(self.choices)}, not {value!r}")
            return value
        raise AssertionError(f"unknown check kind {kind!r}")

    def describe(self) -> str:
        """The accepted values in a few words (`check-config --keys`)."""
        kind = self.kind
        if kind == "choice":
            text = " | ".join(str(c) for c in self.choices)
        elif kind in ("number", "integer"):
            low, high = self.minimum, self.maximum
            if self.positive:
                text = f"{kind} > 0"
            elif low is not None and high is not None:
                text = f"{kind} {low:g}..{high:g}"
            elif low is not None:
                text = f"{kind} >= {low:g}"
            elif high is not None:
                text = f"{kind} <= {high:g}"
            else:
                text = kind
        elif kind == "listen":
            text = "host:port"
        elif kind == "header":
            text = "header name"
        elif kind == "strings":
            text = "list of strings"
        else:
            text = kind
        return f"{text} or null" if self.nullable else text


def setting(default: Any, check: Check) -> Any:
    """A settings record's field that a user sets: its default and how its YAML value is checked."""
    return field(default=default, metadata={CHECK: check})


def setting_from(factory: Any, check: Check) -> Any:
    """`setting` with a default made per record (a mutable or computed default)."""
    return field(default_factory=factory, metadata={CHECK: check})


def yaml_keys(record: type) -> tuple[str, ...]:
    """The YAML keys of a settings record's section: its fields set at construction."""
    return tuple(f.name for f in fields(record) if f.init)


def declared(record: type, section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The values of `section`'s keys that `record` declares a Check for, each read by it (a
    required one that is missing is named). Keys are not checked here: see `section()`."""
    values: dict[str, Any] = {}
    for f in fields(record):
        check = f.metadata.get(CHECK)
        if check is None:
            continue
        if f.name in section:
            values[f.name] = check.read(section[f.name], f"{where}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{where} needs '{f.name}'")
    return values


def section(record: type[R], raw: Any, where: str, **given: Any) -> R:
    """A settings record from its YAML mapping (None: the defaults): unknown keys refused, declared
    ones checked; `given` are the values of the keys its own parser read."""
    values = mapping(raw, where)
    check_keys(values, yaml_keys(record), where)
    return record(**{**declared(record, values, where), **given})


def defaults(record: type) -> dict[str, Any]:
    """The default of each declared key of a record (those computed at start-up left out)."""
    out: dict[str, Any] = {}
    for f in fields(record):
        if CHECK not in f.metadata:
            continue
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def checks(record: type) -> dict[str, Check]:
    """Each declared key's Check."""
    return {f.name: f.metadata[CHECK] for f in fields(record) if CHECK in f.metadata}


# -- shipped configuration files ------------------------------------------------------------------
def shipped_configs() -> Path:
    """The folder of example configs that ships inside the package (the repository's envoy/ folder):
    Envoy configs and service YAMLs that agree, for `llm-extproc init`, the demo and the tests."""
    return Path(str(importlib.resources.files("extproc") / "configs"))


# -- service ---------------------------------------------------------------------------------------
ENV_CONFIG = "LLM_EXTPROC_CONFIG"
ENV_REDIS_PASSWORD = "LLM_EXTPROC_REDIS_PASSWORD"
ENV_REDIS_SENTINEL_PASSWORD = "LLM_EXTPROC_REDIS_SENTINEL_PASSWORD"
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


HEADER = Check("header")


@dataclass(slots=True)
class HeaderNames:
    """`headers:`: the names of the headers the service reads and sets (lower-cased)."""

    destination_cluster: str = setting("x-llm-destination-cluster", HEADER)
    destination_endpoint: str = setting("x-gateway-destination-endpoint", HEADER)
    session: str = setting("x-session-id", HEADER)
    user: str = setting("x-user-id", HEADER)
    priority: str = setting("x-llm-priority", HEADER)
    ttft_slo: str = setting("x-llm-ttft-slo-ms", HEADER)  # the client's TTFT objective (opt-in shedding)
    tpot_slo: str = setting("x-llm-tpot-slo-ms", HEADER)  # the client's TPOT objective (opt-in shedding)
    ticket: str = setting("x-llm-ticket", HEADER)  # set on routed requests; the access log echoes it
    stream: str = setting("x-llm-stream", HEADER)  # set on streaming requests (a header timeout)


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
# The TPOT gate closes at this share of `max_tpot_s` (and `slo-tpot` sheds at this share of a
# request's objective): what is admitted now shows in the smoothed figure only seconds later, and a
# gate held at the objective itself leaves half the requests over it.
DEFAULT_TPOT_MARGIN = 0.9


POSITIVE = Check("number", positive=True)
POSITIVE_OR_NULL = Check("number", positive=True, nullable=True)


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

    enabled: bool = setting(False, Check("boolean"))
    max_waiting_per_weight: float = setting(DEFAULT_ADMISSION_MAX_WAITING_PER_WEIGHT, POSITIVE)
    max_inflight_per_weight: float = setting(DEFAULT_ADMISSION_MAX_INFLIGHT_PER_WEIGHT, POSITIVE)
    max_kv_usage: float | None = setting(None, Check("number", minimum=0.0, maximum=1.0, nullable=True))
    """A candidate whose engine reports at least this KV-cache usage has no headroom (None: unused)."""
    max_predicted_wait_s: float | None = setting(None, POSITIVE_OR_NULL)
    """A candidate whose predicted prefill queue (the default profile's `predicted-ttft` model,
    seconds) reaches this has no headroom; below it, the headroom is what is left over the mean
    prefill of a request sent there (None: unused)."""
    max_tpot_s: float | None = setting(None, POSITIVE_OR_NULL)
    """The TPOT objective (None: unused): a candidate whose engine's time per output token (the
    snapshots' interval means, smoothed over `tpot_window_s`) is at or above `tpot_margin` of it has
    no headroom: one more sequence there slows every running one. Only while the model is saturated
    does it also restrict placement."""
    tpot_margin: float = setting(DEFAULT_TPOT_MARGIN, Check("number", positive=True, maximum=1.0))
    """The share of `max_tpot_s` at which the TPOT gate closes, in (0, 1] (DEFAULT_TPOT_MARGIN: why)."""
    tpot_window_s: float = setting(DEFAULT_TPOT_WINDOW_S, POSITIVE)
    max_queued: int = setting(DEFAULT_ADMISSION_MAX_QUEUED, Check("integer", minimum=0))
    max_wait_s: float = setting(DEFAULT_ADMISSION_MAX_WAIT_S, POSITIVE)
    overload_after_s: float = setting(DEFAULT_ADMISSION_OVERLOAD_AFTER_S, POSITIVE)
    overload_wait_s: float | None = setting(DEFAULT_ADMISSION_OVERLOAD_WAIT_S, POSITIVE_OR_NULL)
    """Once a model's queue has not been empty for `overload_after_s`, its waiters are served newest
    first and those queued longer than this get 429 at once (None: FIFO up to `max_wait_s` always)."""
    retry_after_s: int = setting(DEFAULT_ADMISSION_RETRY_AFTER_S, Check("integer", minimum=1))
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
    values = mapping(raw, where)
    given: dict[str, Any] = {}
    if values.get("objectives") is not None:
        given["objectives"] = class_objectives(values["objectives"], f"{where}.objectives")
    if "client_max_priority" in values:
        given["client_max_priority"] = priority_value(
            values["client_max_priority"], f"{where}.client_max_priority"
        )
    return section(AdmissionSettings, values, where, **given)


@dataclass(slots=True, frozen=True)
class EnginePriority:
    """`engine_priority:` in the service YAML: write each request's priority class into its body, as
    the number the engines schedule by, so an engine serves a critical request ahead of its own queue.

    vLLM reads the body's `priority` (lower runs first; only with `--scheduling-policy priority`,
    otherwise a non-zero value is a 400), hence the defaults. For an engine that runs higher values
    first, swap the numbers. The client's own value for the field is overwritten: its class comes
    from the priority header and the route, which it cannot raise past the route's cap."""

    field: str = "priority"
    critical: int = setting(-1, Check("integer"))
    standard: int = setting(0, Check("integer"))
    sheddable: int = setting(1, Check("integer"))
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
    values = mapping(raw, where)
    given: dict[str, Any] = {}
    if "field" in values:
        name = string(values["field"], f"{where}.field")
        if not name.isidentifier():
            raise ConfigError(f"{where}.field must be a JSON field name like 'priority', not {name!r}")
        given["field"] = name
    if values.get("clusters") is not None:
        given["clusters"] = frozenset(string_list(values["clusters"], f"{where}.clusters", empty=False))
    return section(EnginePriority, values, where, **given)


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


STRING_OR_NULL = Check("string", nullable=True)


@dataclass(slots=True)
class RedisSettings:
    """Where the fleet's snapshots live. Key names are derived here so publisher and service agree.

    Topology (docs/fleet-state.md): a plain `redis://` / `rediss://` / `unix://` URL is one server;
    `redis+sentinel://h:p,h:p/<master>/<db>` (or `sentinels:` + `master_name:`) follows the master
    that Sentinel names; `redis+cluster://h:p,h:p` (or `cluster: true`) is a Redis Cluster, where
    every key of the pool carries one hash tag so the pool lives in one slot."""

    url: str = setting(DEFAULT_REDIS_URL, Check("string"))
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = setting(None, STRING_OR_NULL)
    pool: str = setting("default", Check("string"))
    key_prefix: str | None = setting(None, STRING_OR_NULL)
    resync_interval_s: float = setting(5.0, POSITIVE)
    # Service only: READY snapshots this many of their own TTLs past expiry still serve a model with no
    # fresh READY instance (STALE_READY_GRACE_TTLS above); 0 turns the grace off.
    stale_ready_grace_ttls: float = setting(
        STALE_READY_GRACE_TTLS, Check("number", minimum=0.0, maximum=100.0)
    )
    sentinels: tuple[str, ...] = setting((), Check("strings", empty=True))  # "host:port" of each
    # Sentinel; needs master_name
    master_name: str | None = setting(None, STRING_OR_NULL)
    # The Sentinels' own credentials (their `requirepass` / ACL user), apart from the data nodes'
    # username/password: Helm charts with auth on protect both, often with the same password.
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    # TLS to the Sentinels themselves; None: as to the data nodes (rediss+sentinel://)
    sentinel_tls: bool | None = setting(None, Check("boolean", nullable=True))
    cluster: bool = setting(False, Check("boolean"))

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


def redis_settings(
    raw: Any, where: str, password_env: str | None = None, sentinel_password_env: str | None = None
) -> RedisSettings:
    """A validated RedisSettings from a YAML mapping; the password falls back to `password_env`, the
    Sentinels' to `sentinel_password_env`."""
    raw = mapping(raw, where)
    values: dict[str, Any] = {}
    for key in ("password", "username", "sentinel_password", "sentinel_username"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            # Not echoed (a numeric password is still a password); YAML turns `12345` into a number
            # (and `0123` into 83): only a quoted string is taken as written.
            raise ConfigError(
                f"{where}.{key} must be a string: quote it in the YAML ({key}: '...'); "
                f"got a {type(value).__name__} (not shown)"
            )
        if value is not None:
            values[key] = string(value, f"{where}.{key}")
    settings = section(RedisSettings, raw, where, **values)
    if settings.sentinels and settings.is_cluster:
        raise ConfigError(f"{where}: choose Sentinel or Cluster, not both")
    topology = redis_topology(settings, where)
    if topology.kind != "sentinel" and (settings.sentinel_password or settings.sentinel_username):
        raise ConfigError(
            f"{where}: sentinel_username / sentinel_password are for Sentinel (redis+sentinel:// or "
            "'sentinels'); the data nodes' credentials are username / password"
        )
    if topology.kind != "sentinel" and settings.sentinel_tls is not None:
        raise ConfigError(
            f"{where}: sentinel_tls is for Sentinel (redis+sentinel:// or 'sentinels'); TLS to one "
            "server or a Cluster is the URL's rediss:// scheme"
        )
    if settings.password is None and password_env is not None:
        settings.password = os.environ.get(password_env) or None
    if (
        settings.sentinel_password is None
        and sentinel_password_env is not None
        and topology.kind == "sentinel"
    ):
        settings.sentinel_password = os.environ.get(sentinel_password_env) or None
    return settings


# -- publisher -------------------------------------------------------------------------------------
# Snapshots every half second: a cold fleet's batch limits and queues show one snapshot after they
# form, and until then admission cannot keep places for critical requests (docs/tuning.md, "Class
# objectives"). The Gateway API Inference Extension's endpoint picker refreshes every 50 ms.
DEFAULT_PUBLISH_INTERVAL_S = 0.5
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


# -- service sections read by config.py ---------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class BodySettings:
    """How request bodies are parsed (`bodies:`; lifecycle/bodies.py)."""

    offload_bytes: int = setting(DEFAULT_BODY_OFFLOAD_BYTES, Check("integer", minimum=1))
    """Bodies at least this big are parsed in a worker process, smaller ones on the event loop."""
    workers: int = setting(DEFAULT_BODY_WORKERS, Check("integer", minimum=1))
    """Worker processes, started as big bodies need them: also the most big bodies parsed at once
    (the others wait their turn, never holding the event loop)."""
    trim_interval_s: float = setting(DEFAULT_BODY_TRIM_INTERVAL_S, Check("number", minimum=0))
    """Hand freed memory back to the OS this long after big bodies stop; 0: never (glibc defaults)."""
    worker_nice: int = setting(DEFAULT_BODY_WORKER_NICE, Check("integer", minimum=0, maximum=19))
    """CPU niceness of the workers (0-19): big bodies yield CPU to the event loop."""


@dataclass(slots=True, frozen=True)
class SyncSettings:
    """Replicas sharing their decisions through the fleet's Redis (`sync:`; server/sync.py,
    docs/fleet-state.md "Shared state between replicas")."""

    enabled: bool = setting(True, Check("boolean"))
    """On by default whenever `fleet:` configures Redis; without Redis there is nothing to share."""
    interval_s: float = setting(0.02, POSITIVE)
    """How often this replica publishes its decisions (when it has any)."""
    heartbeat_s: float = setting(0.5, POSITIVE)
    """The longest silence: an idle replica still publishes its in-flight counts this often."""
    expire_s: float = setting(3.0, POSITIVE)
    """Another replica's counts (and pinned cache blocks) are dropped after this long without a word."""
    max_message_bytes: int = setting(512 * 1024, Check("integer", minimum=1))
    max_updates_per_s: int = setting(20_000, Check("integer", minimum=1))
    """Beyond these, updates are dropped (counted) and peers release what this replica pinned."""
    state_interval_s: float = setting(5.0, POSITIVE)
    """How often the learnt state is written to Redis for a replica that starts late."""
    key_file: str | None = None
    """A file holding the replicas' shared HMAC key (else $LLM_EXTPROC_SYNC_KEY; never the key in
    the YAML): messages and state dumps are signed, unsigned or forged ones dropped (server/sync.py)."""


def sync_settings(raw: Any, base_dir: str | os.PathLike[str] | None = None) -> SyncSettings:
    """`sync:`; a relative `key_file` is in the config file's folder."""
    where = "config: 'sync'"
    values = mapping(raw, where)
    given: dict[str, Any] = {}
    if values.get("key_file") is not None:
        given["key_file"] = str(Path(base_dir or ".") / string(values["key_file"], f"{where}.key_file"))
    settings = section(SyncSettings, values, where, **given)
    if settings.expire_s <= settings.heartbeat_s:
        raise ConfigError(f"{where}.expire_s must exceed heartbeat_s (a live replica would expire)")
    return settings


# A client asks for the decision header with `x-llm-explain: 1` (honoured only with `header: on_request`).
EXPLAIN_REQUEST_HEADER = "x-llm-explain"
MAX_KEEP_LAST = 10_000


@dataclass(slots=True, frozen=True)
class ExplainSettings:
    """`explain:` (scheduling/explain.py).

    header: `off` (default; `false` too): no header whatever the client sends. `on_request` (`true`
    too): only for requests carrying `x-llm-explain: 1`, so a client cannot turn work on unless the
    operator allowed it, and even then pays only for its own requests. `always`: every routed request
    (a staging gateway). keep_last: decisions kept for /debug/decisions; 0 (default) turns the endpoint
    off (404) and records nothing. While it is above 0 every decision is recorded (a copy of what
    each plugin returned; its cost: docs/benchmarks.md, "Decision explanation"). detail: what the
    header tells the client: `summary` (default) the picked cluster, the profile and the candidate
    count; `full` also the picked upstream's id (`cluster/ip:port` in endpoint mode), its calibration
    figures and the top candidates' ids, totals and per-scorer contributions, which expose upstream
    addresses and what the prefix scorers know of other clients' prompts: only where the header's
    readers are trusted. /debug/decisions (the metrics port, operators only) is always complete."""

    header: str = setting(
        "off",
        Check(
            "choice",
            choices=("off", "on_request", "always"),
            aliases=((True, "on_request"), (False, "off"), (None, "off")),
        ),
    )
    keep_last: int = setting(0, Check("integer", minimum=0, maximum=MAX_KEEP_LAST))
    detail: str = setting("summary", Check("choice", choices=("summary", "full")))

    def wants_header(self, headers: Mapping[str, str]) -> bool:
        """Whether this request's response gets the decision header."""
        if self.header == "off":
            return False
        return self.header == "always" or headers.get(EXPLAIN_REQUEST_HEADER, "").strip() == "1"

    def header_for(self, explanation: Explained) -> str:
        """The decision header's value at this `detail` level."""
        return explanation.header_value() if self.detail == "full" else explanation.summary_value()


class Explained(Protocol):
    """A decision's explanation (scheduling/explain.Explanation), as the header reads it."""

    def header_value(self) -> str: ...

    def summary_value(self) -> str: ...


def explain_settings(raw: Any) -> ExplainSettings:
    return section(ExplainSettings, raw, "config: 'explain'")


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(slots=True, frozen=True)
class KubernetesDiscovery:
    """`discovery.kubernetes`: EndpointSlices (discovery.k8s.io/v1) selected by label, listed then
    watched through the API server's HTTP API with the pod's service-account token (RBAC:
    get/list/watch endpointslices; extproc.discovery.kubernetes)."""

    cluster: str = field(metadata={CHECK: Check("string")})
    """The pool cluster (endpoint routing mode) whose endpoints this fills."""
    label_selector: str = field(metadata={CHECK: Check("string")})
    """Which EndpointSlices, e.g. `kubernetes.io/service-name=vllm` (the Service's slices)."""
    namespace: str
    """Default: the pod's namespace (its service-account file), else "default"."""
    api_server: str
    """Default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT."""
    port: int | None = setting(None, Check("integer", minimum=1, maximum=65535, nullable=True))
    """The model servers' port; None: the slice's port named `port_name`, else its first port."""
    port_name: str | None = setting(None, STRING_OR_NULL)
    token_file: str | None = setting(str(SERVICE_ACCOUNT_DIR / "token"), STRING_OR_NULL)
    """Read again for every request (projected tokens rotate); None: no Authorization header."""
    ca_file: str | None = setting(str(SERVICE_ACCOUNT_DIR / "ca.crt"), STRING_OR_NULL)
    """CA for an https API server; None: the system's CAs."""
    watch_timeout_s: int = setting(300, Check("integer", minimum=1))
    """Each watch asks the API server to end after this long; the next one resumes where it ended."""
    retry_max_s: float = setting(10.0, Check("number", minimum=0.5))
    """Errors back off from 0.5 s up to this."""


@dataclass(slots=True, frozen=True)
class DiscoverySettings:
    """`discovery:`: where a pool cluster's endpoints come from at run time."""

    kubernetes: KubernetesDiscovery | None = None

    def clusters(self) -> tuple[str, ...]:
        return (self.kubernetes.cluster,) if self.kubernetes is not None else ()


def _default_api_server() -> str:
    """In a pod: the API server Kubernetes names in the environment."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def _default_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def discovery_settings(raw: Any) -> DiscoverySettings | None:
    """None when the YAML has no `discovery:` (static endpoints only)."""
    if raw is None:
        return None
    where = "config: 'discovery'"
    values = mapping(raw, where)
    check_keys(values, ("kubernetes",), where)
    if values.get("kubernetes") is None:
        return DiscoverySettings()
    where = f"{where}.kubernetes"
    k8s = mapping(values["kubernetes"], where)
    if k8s.get("port") is not None and k8s.get("port_name") is not None:
        raise ConfigError(f"{where}: give 'port' or 'port_name', not both")
    api_server = string(k8s.get("api_server") or _default_api_server(), f"{where}.api_server")
    if not api_server.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.api_server must be an http:// or https:// URL, got {api_server!r}")
    namespace = string(k8s.get("namespace") or _default_namespace(), f"{where}.namespace")
    settings = section(
        KubernetesDiscovery, k8s, where, namespace=namespace, api_server=api_server.rstrip("/")
    )
    return DiscoverySettings(kubernetes=settings)


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


def integer(value: Any, where: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if maximum is not None and minimum is not None and not minimum <= value <= maximum:
        raise ConfigError(f"{where} must be an integer from {minimum} to {maximum}, got {value!r}")
    if minimum is not None and value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{where} must be {wanted}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be an integer <= {maximum}, got {value!r}")
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
