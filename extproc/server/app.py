"""The gRPC server: ext_proc + gRPC health on one port, /metrics on another, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config import ServiceConfig
from extproc.discovery import EndpointSource, PoolUpdater
from extproc.fleet import FleetView, RemoteInFlight
from extproc.fleet.kv_index import KvIndex, KvIndexFeed
from extproc.fleet.redis_feed import RedisFeed
from extproc.lifecycle import RequestLifecycle
from extproc.server.completions import AccessLogReceiver, PendingReleases
from extproc.server.health import HealthStates
from extproc.server.relay import ReleaseRelay
from extproc.server.stream import ExternalProcessor
from extproc.server.sync import ReplicaSync, pool_upstreams
from extproc.settings import GIL_SWITCH_INTERVAL_S, TlsSettings
from extproc.telemetry import Metrics, MetricsServer, supervision
from extproc.telemetry.metrics import Page, Probe
from extproc.telemetry.supervision import supervised

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_DRAIN_POLL_S = 0.05
_DRAIN_IDLE_POLLS = 3


@dataclass(slots=True)
class RunningService:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    lifecycle: RequestLifecycle
    metrics: Metrics
    metrics_server: MetricsServer | None
    feed: RedisFeed | None = None
    sweeper: asyncio.Task[None] | None = None  # releases access-log tickets that never came back
    relay: ReleaseRelay | None = None
    heartbeat: asyncio.Task[None] | None = None  # the event loop's pulse, read by /healthz
    sync: ReplicaSync | None = None  # decisions shared with the other replicas (server/sync.py)
    discovery: tuple[EndpointSource, ...] = ()  # endpoint sources filling the pool (extproc.discovery)
    health_updates: asyncio.Task[None] | None = None  # gRPC health names follow the probes (health.py)
    phase: str = "serving"  # serving -> announce -> drain -> stopped
    kv_index: KvIndexFeed | None = None  # the precise prefix index from engines' KV events

    async def stop(
        self, grace: float, *, announce: float = 0.0, skip_announce: asyncio.Event | None = None
    ) -> None:
        """Shut down in phases (docs/operations.md, "Restarts and replica failure"):

        1. announce: gRPC health NOT_SERVING (every service name), but new streams are still accepted
           for `announce` seconds (cut short when `skip_announce` is set), so Envoy's health check
           moves traffic to other replicas before anything is refused;
        2. drain: stop accepting streams; open ext_proc streams get up to `grace` seconds to finish;
        3. cancel: whatever is still open is cancelled; background work and /metrics are closed.
        """
        await self.announce(announce, skip_announce)
        await self.drain(grace)
        await self.close()

    def open_streams(self) -> int:
        """ext_proc streams this process is handling now."""
        value = self.metrics.registry.get_sample_value("llm_extproc_active_streams")
        return int(value or 0)

    async def announce(self, seconds: float, skip: asyncio.Event | None = None) -> None:
        self.phase = "announce"
        await self.health.enter_graceful_shutdown()
        log.info(
            "shutdown 1/3 announce: health NOT_SERVING, still accepting streams for %.1fs "
            "(%d open) so Envoy's health check moves traffic away",
            seconds,
            self.open_streams(),
        )
        if seconds <= 0:
            return
        skip = skip or asyncio.Event()
        with contextlib.suppress(TimeoutError):  # the timeout is the normal end of the period
            await asyncio.wait_for(skip.wait(), seconds)

    async def drain(self, grace: float) -> None:
        self.phase = "drain"
        log.info(
            "shutdown 2/3 drain: no new streams; %d open ext_proc streams get up to %.1fs to finish",
            self.open_streams(),
            grace,
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopping = asyncio.ensure_future(self.server.stop(grace))
        # server.stop(grace) waits for every RPC, including long-lived streams that are not requests
        # (Envoy's gRPC access-log stream, health Watch): once no ext_proc stream has been open for a
        # few polls (a call accepted just before the stop may not have started its handler yet),
        # cancel those instead of waiting out the whole grace period.
        idle_polls = left = 0
        while not stopping.done():
            left = self.open_streams()
            idle_polls = idle_polls + 1 if left == 0 else 0
            if idle_polls >= _DRAIN_IDLE_POLLS:
                break
            await asyncio.wait({stopping}, timeout=_DRAIN_POLL_S)
        if not stopping.done():
            await self.server.stop(0)  # cancels every remaining call
        await stopping
        elapsed = loop.time() - started
        if left and elapsed >= grace:
            log.warning(
                "shutdown 3/3 cancel: %d ext_proc streams still open after %.1fs were cancelled",
                left,
                elapsed,
            )
        else:
            log.info("shutdown 3/3 cancel: drained in %.1fs, nothing left to cancel", elapsed)

    async def close(self) -> None:
        self.phase = "stopped"
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        if self.health_updates is not None:
            self.health_updates.cancel()
        for source in self.discovery:
            await source.stop()
        if self.relay is not None:
            await self.relay.stop()
        if self.sync is not None:
            await self.sync.stop()
        if self.kv_index is not None:
            await self.kv_index.stop()
        if self.feed is not None:
            await self.feed.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.lifecycle.config.tokenizers is not None:
            self.lifecycle.config.tokenizers.close()
        self.lifecycle.close()  # the body-parser worker processes


class _Probes:
    """HTTP probes on the metrics port (read from its thread; the event loop writes the state).

    /healthz: the process is alive *and* its event loop turns (a beat within LOOP_STALL_S), so a
    wedged loop gets the pod restarted. /readyz: ready for new requests: serving, not shutting down,
    and the loop turning. Neither depends on Redis or the engines: without them the service still
    routes (fallbacks), and a readiness tied to them would take every replica out at once. A
    background loop that keeps failing (telemetry/supervision.py) does fail readiness: the view it
    keeps would freeze."""

    LOOP_STALL_S = 10.0
    BEAT_S = 1.0

    def __init__(self) -> None:
        self.running: RunningService | None = None
        self.last_beat = time.monotonic()

    def paths(self) -> dict[str, Probe]:
        return {"/healthz": self.live, "/readyz": self.ready, "/serving": self.serving}

    def serving(self) -> tuple[bool, str]:
        """Ready and able to pick (every endpoint source has listed the pool, some endpoint is in
        it): what gRPC health says for the ext_proc service name, over HTTP for a kubelet probe
        when the gRPC port requires client certificates."""
        ok, reason = self.ready()
        if not ok:
            return ok, reason
        running = self.running
        if running is None or not _can_pick(running.lifecycle.config, running.discovery):
            return False, "not serving: no endpoint to pick yet"
        return True, "serving"

    async def beat_forever(self) -> None:
        while True:
            self.last_beat = time.monotonic()
            await asyncio.sleep(self.BEAT_S)

    def live(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self.last_beat
        if stalled > self.LOOP_STALL_S:
            return False, f"event loop stalled for {stalled:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        ok, reason = self.live()
        if not ok:
            return ok, reason
        phase = self.running.phase if self.running is not None else "starting"
        if phase != "serving":
            return False, f"not ready: {phase}"
        failing = supervision.failing()  # e.g. the fleet view can no longer be kept fresh
        return (False, "not ready: " + "; ".join(failing)) if failing else (True, "ready")


ROLES = ("main", "bulk")


def replica_id(role: str) -> str:
    """A random id per process; the bulk process's starts with "bulk" (never hex), which envoy.yaml's
    second access logger matches to report big bodies' ends to that process directly."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    return ("bulk" if role == "bulk" else "") + os.urandom(4).hex()


class _CertificateFiles:
    """The TLS files, read again when one changes: gRPC asks at each new connection's handshake, so
    a rotated Secret is used from the next connection on, with no restart."""

    def __init__(self, tls: TlsSettings) -> None:
        self.tls = tls
        self._files = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p is not None]
        self._seen = self._stamps()

    def _stamps(self) -> list[tuple[int, int]]:
        stamps = []
        for path in self._files:
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((0, 0))
        return stamps

    def current(self) -> grpc.ServerCertificateConfiguration:
        tls = self.tls
        ca = tls.client_ca_file.read_bytes() if tls.client_ca_file is not None else None
        pair = [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())]
        return grpc.ssl_server_certificate_configuration(pair, root_certificates=ca)

    def changed(self) -> grpc.ServerCertificateConfiguration | None:
        stamps = self._stamps()
        if stamps == self._seen:
            return None
        try:
            fresh = self.current()
        except OSError as exc:  # mid-rotation: keep the current files, try at the next handshake
            log.warning("TLS files changed but cannot be read yet: %s", exc)
            return None
        self._seen = stamps
        log.info("TLS files changed: new connections use them")
        return fresh


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """TLS on the gRPC port; with a client CA, clients without a certificate it signed are refused
    at the handshake (mTLS)."""
    files = _CertificateFiles(tls)
    return grpc.dynamic_ssl_server_credentials(
        files.current(), files.changed, require_client_authentication=tls.client_ca_file is not None
    )


def _completions(
    config: ServiceConfig, lifecycle: RequestLifecycle, server: grpc.aio.Server, replica: str
) -> tuple[PendingReleases | None, ReleaseRelay | None, asyncio.Task[None] | None]:
    """With `release_on: access_log`: the ticket table, Envoy's access-log receiver (relaying other
    replicas' tickets through Redis when the fleet uses it), the sweeper."""
    if config.release_on != "access_log":
        return None, None, None
    pending = PendingReleases(lifecycle, config.lease_timeout_s, replica=replica)
    relay = ReleaseRelay(config.fleet, pending) if config.fleet is not None else None
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(
        AccessLogReceiver(pending, config.headers.ticket, relay.forward if relay else None), server
    )
    sweeper = asyncio.get_running_loop().create_task(supervised("lease-sweeper", pending.sweep_forever))
    return pending, relay, sweeper


def _pages(lifecycle: RequestLifecycle) -> dict[str, Page]:
    """Debug pages on the metrics port, each only when its setting turns it on (404 otherwise)."""
    if lifecycle.decisions is None:
        return {}
    return {"/debug/decisions": lifecycle.decisions.page}


def _sync(
    config: ServiceConfig, lifecycle: RequestLifecycle, metrics: Metrics, replica: str | None
) -> ReplicaSync | None:
    """With `fleet:` Redis and `sync.enabled`: share decisions and in-flight counts with the other
    replicas (the access-log tickets' replica id names this one)."""
    if config.fleet is None or not config.sync.enabled:
        return None
    remote = RemoteInFlight(config.sync.expire_s)
    lifecycle.state.share(remote)
    lifecycle.admission.peer_critical_rate = remote.critical_rate
    lifecycle.admission.peer_waiting = remote.waiting
    sync = ReplicaSync(
        replica or os.urandom(4).hex(),
        config.profiles,
        lifecycle.inflight,
        remote,
        metrics,
        config.sync,
        config.fleet,
        known_upstreams=pool_upstreams(config.pool, lifecycle.view),
        critical_rates=lifecycle.admission.own_critical_rates,
        waiting=lifecycle.admission.own_waiting,
    )
    lifecycle.admission.on_queue_change = sync.news
    sync.start()
    return sync


async def start(config: ServiceConfig, *, role: str = "main") -> RunningService:
    """Start serving. `role` "bulk": the process envoy.yaml's big-body route sends requests that
    declare >= 1 MiB to (docs/tuning.md, "Big bodies"); it routes like any replica."""
    replica = replica_id(role)
    metrics = Metrics(config.pool.models(), config.pool.cluster_names())
    view = (
        FleetView(config.pool, stale_ready_grace_ttls=config.fleet.stale_ready_grace_ttls)
        if config.fleet is not None
        else None
    )
    lifecycle = RequestLifecycle(config, metrics, view)
    feed = None
    if config.fleet is not None and view is not None:
        feed = RedisFeed(config.fleet, view, metrics)
        feed.start()
    limit = config.grpc_max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Envoy holds one stream per in-flight HTTP request: do not cap concurrent streams low.
            ("grpc.max_concurrent_streams", 100_000),
            ("grpc.so_reuseport", 1),
        ]
    )
    pending, relay, sweeper = _completions(config, lifecycle, server, replica)
    if relay is not None:
        relay.start()
    sync = _sync(config, lifecycle, metrics, replica)
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(lifecycle, pending), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.tls is None:
        port = server.add_insecure_port(config.listen)
    else:
        port = server.add_secure_port(config.listen, server_credentials(config.tls))
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(EXT_PROC_SERVICE, serving)
    probes = _Probes()
    metrics_server = (
        MetricsServer(metrics, config.metrics_listen, probes.paths(), _pages(lifecycle))
        if config.metrics_listen
        else None
    )
    log.info(
        "ext_proc %slistening on %s (port %d, %s), metrics on %s, %d clusters, models: %s",
        "(bulk process: big bodies) " if role == "bulk" else "",
        config.listen,
        port,
        "plaintext" if config.tls is None else "mTLS" if config.tls.client_ca_file else "TLS",
        config.metrics_listen or "off",
        len(config.pool.clusters),
        ", ".join(config.pool.models()) or "*",
    )
    kv_index = None
    if config.fleet is not None:  # engines' KV events, where a publisher maps them (fleet/kv_index.py)
        kv_index = KvIndexFeed(config.fleet, KvIndex(), metrics)
        lifecycle.state.kv = kv_index.index
        kv_index.start()
    discovery = _discovery(config, metrics)
    states = HealthStates(
        health_servicer,
        probes.live,
        probes.ready,
        lambda: _can_pick(config, discovery),
        ("", EXT_PROC_SERVICE),
    )
    loop = asyncio.get_running_loop()
    running = RunningService(
        server=server,
        port=port,
        health=health_servicer,
        lifecycle=lifecycle,
        metrics=metrics,
        metrics_server=metrics_server,
        feed=feed,
        sweeper=sweeper,
        relay=relay,
        heartbeat=loop.create_task(probes.beat_forever()),
        sync=sync,
        discovery=discovery,
        health_updates=loop.create_task(supervised("health-updates", states.run_forever)),
        kv_index=kv_index,
    )
    probes.running = running
    await states.update()  # the health names as the probes now answer (serving)
    return running


def _discovery(config: ServiceConfig, metrics: Metrics) -> tuple[EndpointSource, ...]:
    """Start the configured endpoint sources (none: the YAML's endpoints are the pool)."""
    settings = config.discovery
    if settings is None or settings.kubernetes is None:
        return ()
    from extproc.discovery.kubernetes import EndpointSliceWatcher  # aiohttp only when configured

    watcher = EndpointSliceWatcher(settings.kubernetes, PoolUpdater(config.pool, metrics), metrics)
    watcher.start()
    return (watcher,)


def _can_pick(config: ServiceConfig, sources: tuple[EndpointSource, ...]) -> bool:
    """Every source has its first list and some endpoint (or cluster) can be picked."""
    return all(s.synced for s in sources) and bool(config.pool.everything())


def freeze_heap() -> int:
    """Collect once, then move every object alive now into the garbage collector's permanent
    generation; returns how many. A full collection walks every tracked object holding the GIL, and
    a started service has tens of thousands of them (modules, config, plugins): every stream waits
    meanwhile (notebook/benchmarks-history.md, "Tokenization on the request path"). Frozen, later
    collections walk only what was created since. Call it once the service is built: objects frozen
    are never collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(config: ServiceConfig, *, role: str = "main") -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if role == "bulk" and config.bodies.worker_nice:
        # Big bodies' copies and parses must not take CPU from the main process's decisions.
        with contextlib.suppress(OSError):
            os.nice(config.bodies.worker_nice)
    running = await start(config, role=role)
    log.debug("garbage collector: %d objects of the started service frozen", freeze_heap())
    first, again = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not first.is_set():
            log.info(
                "%s: shutting down (announce %.1fs, then drain up to %.1fs)",
                sig.name,
                config.shutdown_announce_s,
                config.shutdown_grace_s,
            )
            first.set()
        elif running.phase in ("serving", "announce"):
            log.info("%s again: skipping the rest of the announce period", sig.name)
            again.set()
        else:
            log.warning("%s: already draining; SIGKILL stops at once", sig.name)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await first.wait()
    await running.stop(config.shutdown_grace_s, announce=config.shutdown_announce_s, skip_announce=again)
    log.info("stopped")
