"""`llm-extproc doctor`: check a running setup from the outside and say what to fix.

Reads what the parts themselves read: the service YAML (as `serve` loads it), Envoy's admin API
(/ready, /clusters, /config_dump) or an envoy.yaml file, and the snapshot keys in Redis (decoded and
validated as the service's RedisFeed does). One `Check` per question; nothing is changed anywhere.
Only when asked (`--probe-engines`) does it send each engine `engine_priority:` writes to one
one-token completion, since vLLM does not publish whether it schedules by priority.
An operator tool at the command-line layer: it never imports the lab.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import AuthenticationError

from extproc.config import ServiceConfig, load_config
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.redis_feed import redis_client
from extproc.fleet.snapshots import InstanceState, SnapshotRejected, decode
from extproc.lifecycle.admission import route_metadata_errors
from extproc.settings import (
    ENV_REDIS_PASSWORD,
    ENV_REDIS_SENTINEL_PASSWORD,
    PROFILE_METADATA_KEY,
    RedisSettings,
    redis_settings,
)

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
DEFAULT_EXT_PROC_CLUSTER = "llm-extproc"


@dataclass(slots=True)
class Check:
    """One answer: `ok` None means skipped (nothing to check), with why in `detail`. `warn`: it
    works, but worse than it could (printed WARN; the exit status stays 0)."""

    name: str
    ok: bool | None
    detail: str
    warn: bool = False

    def line(self) -> str:
        status = "SKIP" if self.ok is None else ("WARN" if self.warn else "OK") if self.ok else "FAIL"
        return f"{status:<4} {self.name}: {self.detail}"


@dataclass(slots=True)
class DoctorOptions:
    config: str | None = None
    envoy_admin: str | None = None
    envoy_config: str | None = None
    redis_url: str | None = None
    timeout_s: float = 3.0
    # Send each engine that `engine_priority:` writes to a one-token request carrying a non-zero
    # priority (the engines' own check: vLLM on FCFS answers 400). Off: doctor changes nothing.
    probe_engines: bool = False
    engine_api_key: str | None = None
    # The service's /metrics (its calibration against the engines). None: from the YAML's
    # metrics_listen (a wildcard address read on loopback).
    service_metrics: str | None = None


async def run_doctor(opts: DoctorOptions) -> list[Check]:
    """Every check, in the order an operator would fix them."""
    checks: list[Check] = []
    config: ServiceConfig | None = None
    try:
        config = load_config(opts.config)
        checks.append(
            Check(
                "service config",
                True,
                f"{len(config.pool.clusters)} clusters ({', '.join(config.pool.cluster_names())}), "
                f"models {', '.join(config.pool.models()) or '*'}",
            )
        )
    except (ValueError, OSError) as exc:
        checks.append(Check("service config", False, f"{exc} (fix the YAML; `llm-extproc check-config`)"))

    envoy_cfg: dict[str, Any] | None = None
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if opts.envoy_admin:
            admin = opts.envoy_admin.rstrip("/")
            reachable = await _check_admin(session, admin, checks)
            if reachable:
                envoy_cfg = await _admin_config(session, admin)
                await _check_ext_proc_cluster(session, admin, _ext_proc_cluster(envoy_cfg), checks)
        else:
            checks.append(Check("envoy admin", None, "not checked: pass --envoy-admin http://HOST:9901"))
    if opts.envoy_config:
        try:
            envoy_cfg = _file_config(Path(opts.envoy_config))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            checks.append(Check("envoy config", False, f"cannot read {opts.envoy_config}: {exc}"))
    if config is not None:
        if envoy_cfg is not None:
            checks.append(_check_clusters(config, envoy_cfg, opts.envoy_config or "Envoy's config_dump"))
            checks.append(check_route_metadata(config, envoy_cfg))
        else:
            checks.append(
                Check("clusters agree", None, "not checked: pass --envoy-admin or --envoy-config envoy.yaml")
            )
        settings = _redis_settings(config, opts.redis_url)
        states: list[InstanceState] = []
        if settings is None:
            checks.append(Check("redis", None, "no `fleet:` in the service YAML and no --redis: static pool"))
        else:
            found, states = await _check_redis(settings, config, opts.timeout_s)
            checks.extend(found)
        if config.admission.enabled and states:
            checks.append(check_batch_limits(config, states))
        if config.engine_priority is not None:
            checks.extend(await _check_engine_priority(config, states, opts))
        checks.append(await _check_calibration(config, opts))
    return checks


# -- calibration -------------------------------------------------------------------------------------
RATIO_OK_TOKENIZER = (0.87, 1.15)  # with the engines' tokenizer the engines count what the service does
RATIO_OK_ESTIMATE = (0.8, 1.25)  # bytes/4 within this of the engines' count: no tokenizer needed
ERROR_WARN_RELATIVE = 1.0  # first tokens twice as late as predicted...
ERROR_WARN_S = 0.5  # ... and by this much: tens of milliseconds late is not worth a warning


def _metrics_url(config: ServiceConfig, opts: DoctorOptions) -> str | None:
    if opts.service_metrics:
        return opts.service_metrics.rstrip("/") + (
            "" if opts.service_metrics.endswith("/metrics") else "/metrics"
        )
    listen = config.metrics_listen
    if listen is None:
        return None
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}/metrics"


def calibration_findings(text: str, config: ServiceConfig) -> tuple[list[str], list[str], dict[str, float]]:
    """(warnings, notes, ratio by upstream) from the service's /metrics text: a token ratio far from
    1 (with a tokenizer: the wrong one; without: bytes/4 miscounts and a tokenizer would help),
    upstreams whose first tokens come much later than predicted, and those the bounded-load guard
    keeps taking out of the choice (a note: the model prefers them past their share)."""
    from prometheus_client.parser import text_string_to_metric_families

    ratios: dict[str, float] = {}
    relative: dict[str, float] = {}
    late: dict[str, float] = {}
    dropped: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            upstream = sample.labels.get("upstream", "")
            if sample.name == "llm_extproc_calibration_token_ratio":
                ratios[upstream] = sample.value
            elif sample.name == "llm_extproc_calibration_ttft_relative_error":
                relative[upstream] = max(relative.get(upstream, 0.0), sample.value)
            elif sample.name == "llm_extproc_calibration_ttft_error_seconds":
                late[upstream] = max(late.get(upstream, 0.0), sample.value)
            elif sample.name == "llm_extproc_bounded_load_dropped_total":
                dropped[upstream] = dropped.get(upstream, 0.0) + sample.value
    registry = config.tokenizers
    models = {c.name: c.models for c in config.pool.clusters}
    warnings, notes = [], []
    for upstream, ratio in sorted(ratios.items()):
        cluster = upstream.split("/", 1)[0]
        with_tokenizer = registry is not None and any(registry.is_exact(m) for m in models.get(cluster, ()))
        lo, hi = RATIO_OK_TOKENIZER if with_tokenizer else RATIO_OK_ESTIMATE
        if lo <= ratio <= hi:
            continue
        if with_tokenizer:
            warnings.append(
                f"{upstream} counts {ratio:.2f} tokens per token of the configured tokenizer: it is not "
                "the engine's tokenizer (`tokenizers:` in the service YAML)"
            )
        else:
            notes.append(
                f"{upstream} counts {ratio:.2f} tokens per 4 bytes of text: calibrated, but configure "
                "the engine's tokenizer (`tokenizers:`) for exact prefix matches"
            )
    for upstream, err in sorted(relative.items()):
        if err > ERROR_WARN_RELATIVE and late.get(upstream, 0.0) > ERROR_WARN_S:
            warnings.append(
                f"{upstream}'s first tokens come {1 + err:.1f}x as late as predicted, "
                f"{late[upstream]:.1f} s (something slows it that its metrics do not show; "
                "docs/tuning.md, Calibration)"
            )
    if dropped:
        top = sorted(dropped.items(), key=lambda kv: -kv[1])[:3]
        notes.append(
            "bounded-load took "
            + ", ".join(f"{u} out {n:.0f} times" for u, n in top)
            + " since the service started (over twice its share with requests waiting there)"
        )
    return warnings, notes, ratios


async def _check_calibration(config: ServiceConfig, opts: DoctorOptions) -> Check:
    url = _metrics_url(config, opts)
    if url is None:
        return Check(
            "calibration", None, "not checked: no metrics_listen in the YAML and no --service-metrics"
        )
    try:
        timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as r:
            text = await r.text()
            if r.status != 200:
                return Check("calibration", None, f"not checked: {url} answered {r.status}")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Check("calibration", None, f"not checked: {url} unreachable ({type(exc).__name__})")
    warnings, notes, ratios = calibration_findings(text, config)
    if not ratios:
        return Check("calibration", None, "nothing learnt yet (no request routed since the service started)")
    summary = (
        f"token ratio {min(ratios.values()):.2f}-{max(ratios.values()):.2f} over {len(ratios)} upstreams"
    )
    if warnings:
        return Check("calibration", True, "; ".join([*warnings, *notes]), warn=True)
    return Check("calibration", True, "; ".join([summary, *notes]))


async def run_doctor_until(opts: DoctorOptions, wait_s: float = 0.0) -> list[Check]:
    """`run_doctor`, repeated every second while a check fails, for up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        checks = await run_doctor(opts)
        if all(c.ok is not False for c in checks) or time.monotonic() >= deadline:
            return checks
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


# -- Envoy -----------------------------------------------------------------------------------------
async def _get(session: aiohttp.ClientSession, url: str, **params: str) -> tuple[int, str]:
    async with session.get(url, params=params or None) as r:
        return r.status, await r.text()


async def _check_admin(session: aiohttp.ClientSession, admin: str, checks: list[Check]) -> bool:
    try:
        status, text = await _get(session, f"{admin}/ready")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        checks.append(
            Check(
                "envoy admin",
                False,
                f"{admin} unreachable ({type(exc).__name__}: {exc or 'timeout'}): is Envoy running, and is "
                "this its admin address (envoy.yaml `admin:`)?",
            )
        )
        return False
    state = text.strip() or f"HTTP {status}"
    if status != 200:
        checks.append(Check("envoy admin", False, f"{admin} answers but Envoy is not ready: {state}"))
        return True
    checks.append(Check("envoy admin", True, f"{admin}: {state}"))
    return True


async def _admin_config(session: aiohttp.ClientSession, admin: str) -> dict[str, Any]:
    """Clusters and listeners from /config_dump, shaped like an envoy.yaml's static_resources."""
    clusters: list[dict[str, Any]] = []
    listeners: list[dict[str, Any]] = []
    for resource in ("static_clusters", "dynamic_active_clusters"):
        status, text = await _get(session, f"{admin}/config_dump", resource=resource)
        if status == 200:
            for entry in yaml.safe_load(text).get("configs", []):
                if isinstance(entry.get("cluster"), dict):
                    clusters.append(entry["cluster"])
    for resource in ("static_listeners", "dynamic_listeners"):
        status, text = await _get(session, f"{admin}/config_dump", resource=resource)
        if status == 200:
            for entry in yaml.safe_load(text).get("configs", []):
                listener = entry.get("listener") or (entry.get("active_state") or {}).get("listener")
                if isinstance(listener, dict):
                    listeners.append(listener)
    return {"static_resources": {"clusters": clusters, "listeners": listeners}}


def _file_config(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError("not a YAML mapping")
    return doc


def _walk(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _ext_proc_cluster(envoy_cfg: Mapping[str, Any]) -> str:
    """The cluster Envoy's ext_proc filter calls (envoy_grpc.cluster_name), else the shipped name."""
    listeners = envoy_cfg.get("static_resources", {}).get("listeners", [])
    for node in _walk(listeners):
        if node.get("name") == EXT_PROC_FILTER:
            for inner in _walk(node.get("typed_config")):
                grpc = inner.get("envoy_grpc")
                if isinstance(grpc, dict) and isinstance(grpc.get("cluster_name"), str):
                    return str(grpc["cluster_name"])
    return DEFAULT_EXT_PROC_CLUSTER


async def _check_ext_proc_cluster(
    session: aiohttp.ClientSession, admin: str, name: str, checks: list[Check]
) -> None:
    """Envoy's own view of the service: at least one host of the ext_proc cluster passing health checks."""
    status, text = await _get(session, f"{admin}/clusters", format="json")
    statuses = yaml.safe_load(text).get("cluster_statuses", []) if status == 200 else []
    cluster = next((c for c in statuses if c.get("name") == name), None)
    if cluster is None:
        checks.append(Check("llm-extproc cluster", False, f"Envoy has no cluster {name!r}: fix envoy.yaml"))
        return
    healthy: list[str] = []
    sick: list[str] = []
    for host in cluster.get("host_statuses", []):
        sock = host.get("address", {}).get("socket_address", {})
        addr = f"{sock.get('address')}:{sock.get('port_value')}"
        hs = host.get("health_status", {})
        flags = [k for k, v in hs.items() if k.startswith("failed") and v] + (
            [hs["eds_health_status"].lower()] if hs.get("eds_health_status", "HEALTHY") != "HEALTHY" else []
        )
        (sick if flags else healthy).append(f"{addr} ({', '.join(flags)})" if flags else addr)
    if healthy:
        extra = f"; unhealthy: {', '.join(sick)}" if sick else ""
        checks.append(Check("llm-extproc cluster", True, f"{name}: healthy {', '.join(healthy)}{extra}"))
    elif sick:
        checks.append(
            Check(
                "llm-extproc cluster",
                False,
                f"{name}: no healthy host ({', '.join(sick)}): is `llm-extproc serve` running and listening "
                "where the cluster points (--listen / `listen:`), answering gRPC health SERVING?",
            )
        )
    else:
        checks.append(Check("llm-extproc cluster", False, f"{name}: no hosts: give it an endpoint"))


_METADATA_LISTS = ("grpc_initial_metadata", "initial_metadata")


def route_metadata_problems(config: ServiceConfig, envoy_cfg: Mapping[str, Any]) -> list[str]:
    """Every llm-extproc key in the ext_proc metadata of an Envoy config (the filter's
    grpc_service.initial_metadata and each route's ExtProcPerRoute grpc_initial_metadata) whose
    value the service would not accept: an unknown profile, a priority or cap that is not a class,
    an objective that is not a number. The service cannot see these until a request carries them."""
    problems: list[str] = []
    for node in _walk(envoy_cfg):
        for list_key in _METADATA_LISTS:
            entries = node.get(list_key)
            if not isinstance(entries, list):
                continue
            for entry in entries:
                if not isinstance(entry, dict):
                    continue
                key, value = str(entry.get("key", "")), str(entry.get("value", ""))
                if key == PROFILE_METADATA_KEY and value not in config.profiles:
                    problems.append(f"{key}={value!r}: no such profile (known: {', '.join(config.profiles)})")
                    continue
                problem = route_metadata_errors(key, value)
                if problem is not None:
                    problems.append(problem)
    return problems


def check_route_metadata(config: ServiceConfig, envoy_cfg: Mapping[str, Any]) -> Check:
    problems = route_metadata_problems(config, envoy_cfg)
    if problems:
        return Check("route metadata", False, "; ".join(problems) + " (fix envoy.yaml)")
    return Check("route metadata", True, "every ext_proc metadata value is valid")


def _check_clusters(config: ServiceConfig, envoy_cfg: Mapping[str, Any], source: str) -> Check:
    """Every pool cluster exists in Envoy (else requests routed there get 503 NC), and every Envoy cluster
    tagged with llm-extproc metadata is in the pool (else the publisher scrapes engines never routed to)."""
    clusters = envoy_cfg.get("static_resources", {}).get("clusters", []) or []
    envoy_names = {c.get("name") for c in clusters if isinstance(c, dict)}
    tagged = {
        c.get("name")
        for c in clusters
        if isinstance(c, dict) and "llm-extproc" in (c.get("metadata", {}).get("filter_metadata") or {})
    }
    pool = set(config.pool.cluster_names())
    problems = []
    missing = sorted(pool - envoy_names)
    if missing:
        problems.append(
            f"in the service YAML but not in Envoy: {', '.join(missing)} (add them to envoy.yaml's "
            "clusters, or remove them from the YAML's pool)"
        )
    untracked = sorted(str(n) for n in tagged - pool)
    if untracked:
        problems.append(
            f"tagged llm-extproc in Envoy but not in the service YAML's pool: {', '.join(untracked)} "
            "(add them to the pool with their models)"
        )
    if problems:
        return Check("clusters agree", False, f"{source}: " + "; ".join(problems))
    return Check("clusters agree", True, f"{', '.join(sorted(pool))} in both the service YAML and {source}")


# -- Redis and snapshots ---------------------------------------------------------------------------
def _redis_settings(config: ServiceConfig, url: str | None) -> RedisSettings | None:
    """The service's own Redis settings (pool, prefix, TLS), with --redis replacing the URL; the
    password, as for the service, from $LLM_EXTPROC_REDIS_PASSWORD unless the YAML gives one."""
    if url is None:
        return config.fleet
    if config.fleet is None:
        return redis_settings(
            {"url": url},
            "--redis",
            password_env=ENV_REDIS_PASSWORD,
            sentinel_password_env=ENV_REDIS_SENTINEL_PASSWORD,
        )
    return dataclasses.replace(config.fleet, url=redis_settings({"url": url}, "--redis").url)


async def _check_redis(
    settings: RedisSettings, config: ServiceConfig, timeout_s: float
) -> tuple[list[Check], list[InstanceState]]:
    """The Redis checks, and the snapshots read (for the engine probes)."""
    client = redis_client(settings)
    shown = settings.url.split("@")[-1]
    try:
        async with asyncio.timeout(timeout_s):
            await client.ping()
            states, rejected = await _read_snapshots(client, settings, config)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return [
            Check(
                "redis",
                False,
                f"{shown} unreachable ({type(exc).__name__}: {_first(str(exc)) or 'timeout'}): "
                + _redis_hint(exc),
            ),
            Check("snapshots", False, "cannot read them without Redis"),
        ], []
    finally:
        await client.aclose()
    out = [Check("redis", True, f"{shown}: PONG, prefix {settings.prefix}")]
    out.extend(_snapshot_checks(states, rejected, config, settings))
    return out, states


def _first(text: str, most: int = 300) -> str:
    """An error's text cut short: Sentinel's names every Sentinel's connection at length."""
    return text if len(text) <= most else text[:most] + " ..."


# In a MasterNotFoundError's text, one per Sentinel that refused (redis-py names each error's class).
AUTH_FAILED = (
    "AuthenticationError",
    "NOAUTH",
    "WRONGPASS",
    "must be called with the client already authenticated",
)


def _redis_hint(exc: BaseException) -> str:
    """What to fix for a Redis that did not answer: a refused password names whose (Sentinel's
    discovery reports each Sentinel's error inside MasterNotFoundError)."""
    if isinstance(exc, AuthenticationError) or any(word in str(exc) for word in AUTH_FAILED):
        if isinstance(exc, MasterNotFoundError):
            return (
                "the Sentinels refused the credentials: set `fleet.sentinel_password` (or "
                f"${ENV_REDIS_SENTINEL_PASSWORD}) and `fleet.sentinel_username` if they use an ACL user"
            )
        return (
            "Redis refused the credentials: fix `fleet.username` / `fleet.password` "
            f"(or ${ENV_REDIS_PASSWORD})"
        )
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (
            "Redis's TLS certificate is not from a CA this machine trusts: set `fleet.tls_ca_file` to "
            "the CA that signed it (and check the host name or IP in `fleet.url` is in the certificate)"
        )
    if isinstance(exc, MasterNotFoundError):
        return (
            "no Sentinel named the master: check the Sentinels' addresses and the master name in "
            "`fleet.url`, and that TLS matches theirs (`fleet.sentinel_tls`: true for Sentinels on a "
            "TLS port, false for plain Sentinels in front of TLS data nodes)"
        )
    return "start Redis or fix `fleet.url` / --redis"


async def _read_snapshots(
    client: Any, settings: RedisSettings, config: ServiceConfig
) -> tuple[list[InstanceState], list[str]]:
    """Every snapshot key of the pool, decoded without a clock check (freshness is judged after)."""
    keys = [k async for k in client.scan_iter(match=f"{settings.prefix}:snap:*", count=500)]
    values = await client.mget(keys) if keys else []
    known = frozenset(config.pool.cluster_names())
    states: list[InstanceState] = []
    rejected: list[str] = []
    for key, value in zip(keys, values, strict=True):
        if not isinstance(value, bytes):
            continue
        try:
            states.append(decode(value, known))
        except SnapshotRejected as exc:
            rejected.append(f"{key.decode(errors='replace')}: {exc}")
    return states, rejected


def _snapshot_checks(
    states: list[InstanceState], rejected: list[str], config: ServiceConfig, settings: RedisSettings
) -> list[Check]:
    """Per pool cluster (per endpoint in endpoint-picker mode): a fresh READY snapshot, as the service
    needs to route on live load; stale or missing ones fall back to the static pool."""
    now = time.time()
    out: list[Check] = []
    by_cluster: dict[str, list[InstanceState]] = {}
    for s in states:
        by_cluster.setdefault(s.cluster, []).append(s)
    publish = (
        f"is `llm-extproc publish` running against this Redis with pool {settings.pool!r}, and is it "
        "scraping this upstream?"
    )
    for spec in config.pool.clusters:
        found = by_cluster.get(spec.name, [])
        wanted = [f"{spec.name}/{e}" for e in spec.endpoints] if spec.endpoints else []
        name = f"snapshots {spec.name}"
        if not found:
            out.append(Check(name, False, f"no snapshot in Redis: {publish}"))
            continue
        problems, good = [], []
        for s in sorted(found, key=lambda s: s.upstream_id):
            age = now - s.published_at
            if not s.fresh(now):
                problems.append(
                    f"{s.upstream_id} stale ({age:.0f} s old, ttl {s.expires_at - s.published_at:g} s): the "
                    f"publisher {s.publisher_id or '?'} stopped writing it or cannot reach Redis"
                )
            elif not s.ready:
                state = spb.Readiness.Name(s.readiness)
                problems.append(f"{s.upstream_id} {state} (the engine's health or metrics say not ready)")
            else:
                good.append(f"{s.upstream_id} READY {age:.1f} s old")
        seen = {s.upstream_id for s in found}
        problems += [f"{uid}: no snapshot ({publish})" for uid in wanted if uid not in seen]
        if problems:
            out.append(Check(name, False, "; ".join(problems)))
        else:
            out.append(Check(name, True, ", ".join(good)))
            blind = [f"{s.upstream_id}: {', '.join(m)}" for s in found if (m := _missing_signals(s))]
            if blind:
                out.append(
                    Check(f"signals {spec.name}", True, f"{'; '.join(blind)}: {SIGNALS_FIX}", warn=True)
                )
    if rejected:
        out.append(
            Check("snapshots valid", False, f"{len(rejected)} rejected as the service would: {rejected[:3]}")
        )
    return out


# -- engines -------------------------------------------------------------------------------------
BATCH_LIMITS_FIX = (
    "admission learns each engine's batch limit only from its first queue, so after a cold start or "
    "a restart a burst of standard and sheddable requests can fill those batches and queue critical "
    "requests behind them (docs/tuning.md, class objectives). Set `max_num_seqs` to the engine's "
    "--max-num-seqs (vLLM) or --max-running-requests (SGLang) on the publisher's instance, or in the "
    "cluster's `llm-extproc` metadata with --envoy-admin discovery"
)


def check_batch_limits(config: ServiceConfig, states: list[InstanceState]) -> Check:
    """With admission on: does every fresh READY upstream say how many requests it runs at once?
    vLLM publishes no such figure; without it the cold start is the weak part of class separation."""
    now = time.time()
    known = set(config.pool.cluster_names())
    live = [s for s in states if s.cluster in known and s.ready and s.fresh(now)]
    if not live:
        return Check("batch limits", None, "no fresh READY snapshot to read")
    missing = sorted(s.upstream_id for s in live if s.max_num_seqs is None)
    if not missing:
        return Check("batch limits", True, f"max_num_seqs known for all {len(live)} upstreams")
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return Check(
        "batch limits",
        True,
        f"{len(missing)} of {len(live)} upstreams publish no max_num_seqs ({shown}): {BATCH_LIMITS_FIX}",
        warn=True,
    )


async def _check_engine_priority(
    config: ServiceConfig, states: list[InstanceState], opts: DoctorOptions
) -> list[Check]:
    """With `engine_priority:`, every engine it writes to must schedule by the field: vLLM left on
    FCFS answers 400 to a non-zero priority, i.e. to every critical and sheddable request. vLLM does
    not publish its policy, so the only check is to ask: one request of one token per engine, at the
    address its snapshot gives."""
    ep = config.engine_priority
    assert ep is not None
    clusters = [c for c in config.pool.clusters if ep.clusters is None or c.name in ep.clusters]
    names = ", ".join(c.name for c in clusters)
    if not opts.probe_engines:
        return [
            Check(
                "engine priority",
                None,
                f"`{ep.field}` is written for clusters {names}; their engines must schedule by it "
                "(vLLM: --scheduling-policy priority) or they answer 400: pass --probe-engines to ask them",
            )
        ]
    value = next((v for v in (ep.critical, ep.sheddable, ep.standard) if v != 0), None)
    if value is None:
        return [Check("engine priority", None, "every class is written as 0: nothing an engine could refuse")]
    now = time.time()
    headers = {"Authorization": f"Bearer {opts.engine_api_key}"} if opts.engine_api_key else {}
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    out: list[Check] = []
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        for spec in clusters:
            targets = [s for s in states if s.cluster == spec.name and s.address and s.ready and s.fresh(now)]
            name = f"engine priority {spec.name}"
            if not targets:
                out.append(Check(name, None, "no fresh READY snapshot with an address: nothing to ask"))
                continue
            answers = await asyncio.gather(
                *(_probe_priority(session, s, spec.models, ep.field, value) for s in targets)
            )
            bad = [a for ok, a in answers if not ok]
            good = [a for ok, a in answers if ok]
            out.append(Check(name, not bad, "; ".join(bad or good)))
    return out


async def _probe_priority(
    session: aiohttp.ClientSession, state: InstanceState, models: tuple[str, ...], field: str, value: int
) -> tuple[bool, str]:
    """(accepted, what to say) for one engine."""
    # A model both the pool and the engine name, else any the engine names, else the pool's.
    names = [m for m in models if m in state.models] or sorted(state.models) or list(models)
    where = f"{state.upstream_id} ({state.address})"
    if not names:
        return False, f"{where}: its snapshot names no model to ask for"
    model = names[0]
    body = {"model": model, "prompt": "ping", "max_tokens": 1, field: value}
    try:
        async with session.post(f"http://{state.address}/v1/completions", json=body) as r:
            status, text = r.status, await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return False, f"{where}: no answer ({type(exc).__name__}: {exc or 'timeout'})"
    if status == 200:
        return True, f"{where} accepts {field} {value}"
    if status == 400 and "priority" in text.lower():
        return False, (
            f"{where} refuses {field} {value} (HTTP 400: {text.strip()[:160]}): start it with "
            "--scheduling-policy priority (vLLM), or leave its cluster out of engine_priority.clusters"
        )
    return False, f"{where}: HTTP {status} to a one-token request: {text.strip()[:160]}"


SIGNALS_FIX = (
    "it is routed, but blind there. Is the publisher's `engine` for it the server it scrapes (vllm, "
    "sglang, ...; docs/engines.md lists what each publishes), and does its /metrics answer?"
)


def _missing_signals(s: InstanceState) -> list[str]:
    """What a READY snapshot lacks that the default profile reads (what the engines' metrics should
    give): without load figures the fleet's median stands in for its queues; without its KV
    capacity the cache model assumes `default_kv_tokens`."""
    missing = []
    if s.num_running is None and s.num_waiting is None and s.kv_cache_usage is None:
        missing.append("no load figures (running, waiting, KV usage)")
    if not s.kv_blocks_total or not s.block_size:
        missing.append("no KV capacity (blocks and block size)")
    return missing


def report(checks: list[Check]) -> tuple[str, int]:
    """The printed lines and the exit status (1 when any check failed; warnings do not count)."""
    failed = sum(1 for c in checks if c.ok is False)
    warned = sum(1 for c in checks if c.ok and c.warn)
    lines = [c.line() for c in checks]
    note = f" ({warned} warning{'s' if warned > 1 else ''})" if warned else ""
    lines.append(f"{failed} check(s) failed{note}" if failed else f"all checks passed{note}")
    return "\n".join(lines), 1 if failed else 0
