"""Prometheus metrics. One registry per service instance, so tests can run several in one process."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from extproc.telemetry import supervision

# A probe answers (ok, reason): /healthz and /readyz reply 200 or 503 with the reason as text.
Probe = Callable[[], tuple[bool, str]]
# A page answers (HTTP status, content type, body), e.g. /debug/decisions; called on the server's thread.
Page = Callable[[], tuple[int, str, bytes]]

UNKNOWN_MODEL = "unknown"

# The metrics port's HTTP server (MetricsServer): one thread per connection, but at most
# MAX_CONNECTIONS of them; a client silent for SOCKET_TIMEOUT_S (a read or a write) or connected
# longer than CONNECTION_DEADLINE_S (one that trickles a byte at a time) is dropped. When every slot
# is taken, a new connection evicts the oldest one still sending its request head, so clients that
# open connections and send half a request cannot keep scrapes and probes out.
MAX_CONNECTIONS = 32
SOCKET_TIMEOUT_S = 5.0
CONNECTION_DEADLINE_S = 30.0
_SLOT_WAIT_S = 0.25  # how long a new connection waits for an evicted one's slot before it is refused

log = logging.getLogger("extproc.metrics")

# Scheduling plugins' own figures (scheduling.framework.Reporting), read at scrape time: figure name ->
# (metric name, kind, help). Labels: the profile and the upstream.
PLUGIN_FIGURES: dict[str, tuple[str, str, str]] = {
    "token_ratio": (
        "llm_extproc_calibration_token_ratio",
        "gauge",
        "The engine's prompt tokens per token of the service's own count, learnt from the engine's "
        "prompt-token counter (1 until learnt). ~1 with the engines' tokenizer configured; far from 1 "
        "without one, or with a tokenizer that is not the engine's.",
    ),
    "ttft_error_s": (
        "llm_extproc_calibration_ttft_error_seconds",
        "gauge",
        "The engine's observed mean TTFT minus the service's prediction for the same requests, decayed "
        "over ~15 s (positive: later than predicted).",
    ),
    "ttft_relative_error": (
        "llm_extproc_calibration_ttft_relative_error",
        "gauge",
        "That error over the predicted mean TTFT (1: first tokens came twice as late as predicted).",
    ),
    "bounded_load_dropped": (
        "llm_extproc_bounded_load_dropped",
        "counter",
        "Decisions in which the bounded-load guard took this upstream out of the choice (over its "
        "share of the requests in flight).",
    ),
}
# (profile, figure name, upstream id, value) rows: the service's profiles' reporting plugins.
PluginRows = Callable[[], Iterable[tuple[str, str, str, float]]]


class _PluginFigures:
    """A custom collector: the reporting plugins' figures as metric families, built per scrape."""

    def __init__(self, rows: PluginRows) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for profile, figure, upstream, value in self.rows():
            spec = PLUGIN_FIGURES.get(figure)
            if spec is None:
                continue
            name, kind, doc = spec
            family = families.get(figure)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[figure] = cls(name, doc, labels=["profile", "upstream"])
            family.add_metric([profile, upstream], value)
        yield from families.values()

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _LoopFailures:
    """Failures of the supervised background loops running now (telemetry/supervision.py)."""

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "llm_extproc_background_loop_failures",
            "Times each supervised background loop raised and was started again (the loops running "
            "now; one failing 5 times in a row without a 30 s run fails /readyz).",
            labels=["loop"],
        )
        for state in supervision.loops():
            family.add_metric([state.name], state.total_failures)
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


# Decision latency is tens of microseconds to a few milliseconds; buckets cover both ends.
# Plugins are timed (llm_extproc_plugin_seconds) on one decision in this many: each observation is a
# locked histogram update, one per plugin call, a measurable share of a small decision
# (notebook/benchmarks-history.md, "A full batch's turnover, and the decision's CPU"); a sample of
# decisions gives the same distribution.
PLUGIN_TIMING_EVERY = 8
_PLUGIN_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
_QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 5.0)
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Children:
    """A labelled metric's children, looked up once per label set. prometheus_client's `labels()`
    validates, takes a lock and builds its key on every call, and the request path counts
    several series per request. Values go in the metric's label order; only for bounded label sets
    (every child stays cached, as it does in the metric itself)."""

    __slots__ = ("_cache", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self.metric.labels(*values)
        return child


class Metrics:
    def __init__(self, known_models: Iterable[str], clusters: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_LoopFailures())
        self._known_models = frozenset(known_models)
        self.requests = Counter(
            "llm_extproc_requests",
            "Requests seen by the service, by model, destination cluster and outcome.",
            ["model", "cluster", "outcome"],
            registry=self.registry,
        )
        self.errors = Counter(
            "llm_extproc_errors",
            "Requests answered with an error by the service, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "llm_extproc_decision_seconds",
            "Time from the last needed request message to the routing reply (parse + schedule).",
            buckets=_DECISION_BUCKETS,
            registry=self.registry,
        )
        self.inflight = Gauge(
            "llm_extproc_inflight_requests",
            "Requests routed to a cluster and not yet finished, by this service process.",
            ["cluster"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "llm_extproc_active_streams", "Open ext_proc gRPC streams.", registry=self.registry
        )
        self.releases = Counter(
            "llm_extproc_releases",
            "In-flight releases by trigger (response_end: the response finished; stream_end: the "
            "ext_proc stream closed first, e.g. client disconnect; access_log: Envoy's access log "
            "reported the request ended; stream_cancel: the routing stream was reset before the route "
            "reached Envoy, or its entry did not come within 10 s of a reset during the route's "
            "write; expired: no access-log entry within lease_timeout_s).",
            ["trigger"],
            registry=self.registry,
        )
        self.access_log_entries = Counter(
            "llm_extproc_access_log_entries",
            "Envoy access-log entries received, by outcome (released; no_ticket: a request the "
            "service did not route; unknown: a ticket already released or expired; relayed: routed by "
            "another replica and passed on through Redis; other_replica: the same without Redis, "
            "whose lease then expires there).",
            ["outcome"],
            registry=self.registry,
        )
        self.relayed_releases = Counter(
            "llm_extproc_relayed_releases",
            "Access-log tickets of requests another replica routed, relayed through Redis "
            "(sent; dropped: Redis unreachable, the owner's lease expires instead; applied: "
            "received here and released).",
            ["direction"],
            registry=self.registry,
        )
        self.build_info = Gauge(
            "llm_extproc_build_info",
            "Always 1; the labels say which llm-extproc, Python and grpcio run here.",
            ["version", "python", "grpcio"],
            registry=self.registry,
        )
        self.build_info.labels(*_build()).set(1)
        self.access_log_streams = Gauge(
            "llm_extproc_access_log_streams",
            "Open access-log streams from Envoy (release_on: access_log needs at least one).",
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "llm_extproc_fallbacks",
            "Requests routed by weighted round robin over the static pool because no fresh snapshot "
            "exists for the model.",
            ["reason"],
            registry=self.registry,
        )
        self.stale_ready = Counter(
            "llm_extproc_stale_ready_decisions",
            "Requests whose candidates were READY snapshots past their TTL (within the stale-READY "
            "grace) because the model had no fresh READY instance.",
            registry=self.registry,
        )
        self.snapshots = Counter(
            "llm_extproc_snapshots",
            "Snapshots read from Redis, by outcome (accepted, outdated, rejected) and rejection reason.",
            ["outcome", "reason"],
            registry=self.registry,
        )
        self.snapshot_age = Gauge(
            "llm_extproc_snapshot_age_seconds",
            "Age of the newest snapshot held per upstream instance.",
            ["upstream"],
            registry=self.registry,
        )
        self.batch_limit = Gauge(
            "llm_extproc_batch_limit",
            "Requests admission lets run at once per upstream (its batch limit) and where that comes "
            "from: published (max_num_seqs), sequence_cap (learnt; places are kept for critical "
            "requests there), queue (a queue or a full KV cache: bounds admission only), none (0: "
            "unknown, the classes do not separate there yet).",
            ["upstream", "source"],
            registry=self.registry,
        )
        self.fleet_instances = Gauge(
            "llm_extproc_fleet_instances",
            "Instances in the fleet view by state (fresh_ready, fresh_not_ready, stale).",
            ["state"],
            registry=self.registry,
        )
        self.redis_connected = Gauge(
            "llm_extproc_redis_connected",
            "1 while the fleet feed is connected to Redis.",
            registry=self.registry,
        )
        self.redis_reconnects = Counter(
            "llm_extproc_redis_reconnects", "Fleet feed reconnections to Redis.", registry=self.registry
        )
        self.plugin_seconds = Histogram(
            "llm_extproc_plugin_seconds",
            "Time spent in each scheduling plugin per decision, by stage (prepare, filter, scorer, "
            f"picker) and plugin name; one decision in {PLUGIN_TIMING_EVERY} is timed.",
            ["kind", "plugin"],
            buckets=_PLUGIN_BUCKETS,
            registry=self.registry,
        )
        self._plugin_series: dict[tuple[str, str], Any] = {}
        self.tokenized = Counter(
            "llm_extproc_tokenized_requests",
            "Requests whose prompt was tokenized, by source: tokenizer (exact) or estimate (no tokenizer "
            "file for the model: ~4 bytes per token).",
            ["source"],
            registry=self.registry,
        )
        self.tokenized_tokens = Counter(
            "llm_extproc_tokenized_tokens",
            "Prompt tokens of exactly tokenized requests, by whether the per-segment cache had them "
            "(multi-turn chats resend their history: hits are tokens not encoded again).",
            ["cache"],
            registry=self.registry,
        )
        # Replica sync (server/sync.py): decisions shared with the other replicas through Redis.
        self.sync_messages = Counter(
            "llm_extproc_sync_messages",
            "Replica sync messages by direction (sent; received: another replica's, applied; "
            "failed: not published, Redis unreachable; rejected: malformed or oversized; gap: a "
            "replica's sequence skipped, what it had pinned here was released).",
            ["direction"],
            registry=self.registry,
        )
        self.sync_rejected = Counter(
            "llm_extproc_sync_rejected",
            "Replica sync data dropped before it was applied, by reason: whole messages or state "
            "dumps (size, undecodable, signature, version, malformed, time, replay, origins, "
            "too_many, error) and single entries or records (unknown_upstream, count, record, time, "
            "unknown_plugin, rate, waiting).",
            ["reason"],
            registry=self.registry,
        )
        self.sync_updates_dropped = Counter(
            "llm_extproc_sync_updates_dropped",
            "Decision records not shared because a message or the per-second budget was full (peers "
            "then release what this replica pinned).",
            registry=self.registry,
        )
        self.sync_apply_lag = Histogram(
            "llm_extproc_sync_apply_lag_seconds",
            "Time from another replica publishing a sync message to this one applying it (wall "
            "clocks of two hosts: includes their skew).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self.sync_replicas = Gauge(
            "llm_extproc_sync_remote_replicas",
            "Other replicas heard from within sync.expire_s.",
            registry=self.registry,
        )
        self.sync_agreement = Gauge(
            "llm_extproc_sync_agreement",
            "Estimated similarity (Jaccard, 0..1) of this replica's and the last reporting peer's "
            "prefix indexes, averaged over upstreams (sampled every state interval).",
            ["plugin"],
            registry=self.registry,
        )
        self.sync_index_blocks = Gauge(
            "llm_extproc_sync_index_blocks",
            "Prefix-cache blocks a shared scheduling plugin holds per upstream (sampled).",
            ["plugin", "upstream"],
            registry=self.registry,
        )
        # The precise prefix index from engines' KV-cache events (fleet/kv_index.py).
        self.kv_index_messages = Counter(
            "llm_extproc_kv_index_messages",
            "KV index messages from publishers by outcome: applied, old (already covered), buffered "
            "(a sequence gap: waiting for the instance's full set), full (a full set read), rejected.",
            ["outcome"],
            registry=self.registry,
        )
        self.kv_index_blocks = Gauge(
            "llm_extproc_kv_index_blocks",
            "Prefix-index blocks each instance's engine holds by its KV events (sampled).",
            ["upstream"],
            registry=self.registry,
        )
        self.kv_event_lag = Histogram(
            "llm_extproc_kv_event_lag_seconds",
            "From an engine's KV event batch (its timestamp) to the service applying it (wall clocks of "
            "two hosts: includes their skew).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.admission = Counter(
            "llm_extproc_admission",
            "Admission decisions by priority class, decision (admitted, queued, shed, abandoned) and "
            "reason (admitted: free, critical, dequeued; queued/shed: saturated, queue_full, "
            "queue_timeout, slo_unattainable; abandoned: client_gone).",
            ["priority", "decision", "reason"],
            registry=self.registry,
        )
        self.predicted_ttft = Histogram(
            "llm_extproc_predicted_ttft_seconds",
            "Placed requests' own predicted TTFT on the upstream chosen (the profile's TTFT "
            "predictor, queue wait included), by priority class.",
            ["priority"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.observed_ttft = Histogram(
            "llm_extproc_observed_ttft_seconds",
            "Streamed requests' TTFT as Envoy saw it, from the request's start to the response's first "
            "body byte (the access-log entry's first_byte_ms, written by the shipped envoy.yaml's Lua "
            "filter), by priority class. The observed side of llm_extproc_predicted_ttft_seconds.",
            ["priority"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.admission_queue = Gauge(
            "llm_extproc_admission_queue_length",
            "Requests waiting in the admission queue (all models).",
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "llm_extproc_admission_queue_wait_seconds",
            "Time requests spent in the admission queue, by outcome (admitted, timeout, abandoned).",
            ["outcome"],
            buckets=_QUEUE_BUCKETS,
            registry=self.registry,
        )
        # Endpoint-picker protocol (server/picker.py, lifecycle/endpoints.py) and discovery.
        self.endpoint_served = Counter(
            "llm_extproc_endpoint_served",
            "Routed requests whose serving endpoint the proxy reported, by outcome (chosen: the pick; "
            "fallback: a listed fallback after retries, the lease moved there; other: an endpoint not "
            "listed; released: reported after the request ended).",
            ["outcome"],
            registry=self.registry,
        )
        self.discovered_endpoints = Gauge(
            "llm_extproc_discovered_endpoints",
            "Endpoints of each pool cluster currently known from endpoint discovery.",
            ["cluster"],
            registry=self.registry,
        )
        self.discovery_events = Counter(
            "llm_extproc_discovery_events",
            "Endpoint-discovery events by source and kind (list, added, modified, deleted, bookmark, "
            "relist: the watch expired (410 Gone) and the list was read again; error).",
            ["source", "kind"],
            registry=self.registry,
        )
        # The request path's labelled series (model, cluster, outcome / trigger / ...), cached.
        self.requests_by = Children(self.requests)
        self.errors_by = Children(self.errors)
        self.releases_by = Children(self.releases)
        self.access_log_entries_by = Children(self.access_log_entries)
        self.inflight_by = Children(self.inflight)
        self.tokenized_by = Children(self.tokenized)
        self.tokenized_tokens_by = Children(self.tokenized_tokens)
        self.admission_by = Children(self.admission)  # with admission on: every request
        self.predicted_ttft_by = Children(self.predicted_ttft)
        self.observed_ttft_by = Children(self.observed_ttft)
        self.endpoint_served_by = Children(self.endpoint_served)  # endpoint mode: every request
        for cluster in clusters:
            self.inflight_by(cluster).set(0)

    def model_label(self, model: str | None) -> str:
        """Only configured model names become label values: client input must not grow cardinality."""
        if model is None:
            return ""
        return model if model in self._known_models else UNKNOWN_MODEL

    def observe_plugin(self, kind: str, plugin: str, seconds: float) -> None:
        """The scheduling framework's PluginTimer (labelled series cached: this runs per plugin call)."""
        series = self._plugin_series.get((kind, plugin))
        if series is None:
            series = self._plugin_series[(kind, plugin)] = self.plugin_seconds.labels(
                kind=kind, plugin=plugin
            )
        series.observe(seconds)

    def on_inflight_change(self, cluster: str, delta: int) -> None:
        self.inflight_by(cluster).inc(delta)

    def watch_plugins(self, rows: PluginRows) -> None:
        """Expose the scheduling plugins' own figures (PLUGIN_FIGURES), read from `rows` per scrape."""
        self.registry.register(_PluginFigures(rows))


def _build() -> tuple[str, str, str]:
    import platform
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return version("llm-extproc"), platform.python_version(), version("grpcio")


class _Connection:
    __slots__ = ("deadline", "dropped", "reading", "started")

    def __init__(self, started: float, deadline: float) -> None:
        self.started = started
        self.deadline = deadline
        self.reading = True  # still sending its request line and headers
        self.dropped = False  # hung up on by the server: whatever head it sent is not served


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, bounded (see MAX_CONNECTIONS above); serve_forever's thread accepts,
    evicts and enforces the deadlines (service_actions, every poll interval)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the listen backlog: connections wait there while a slot frees

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[WSGIRequestHandler],
        *,
        max_connections: int = MAX_CONNECTIONS,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        if max_connections < 1 or not socket_timeout_s > 0 or not deadline_s > 0:
            raise ValueError("max_connections >= 1, socket_timeout_s > 0 and deadline_s > 0 are required")
        self.socket_timeout_s = socket_timeout_s
        self.deadline_s = deadline_s
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: dict[socket.socket, _Connection] = {}
        self._lock = threading.Lock()
        self.refused = 0  # connections closed unserved: every slot busy with a request under way
        self.evicted = 0  # connections dropped for a newer one while still sending their head
        self.expired = 0  # connections dropped at their deadline
        super().__init__(address, handler)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and (
            not self._evict_one() or not self._slots.acquire(timeout=_SLOT_WAIT_S)
        ):
            self.refused += 1
            self.shutdown_request(request)
            return
        now = time.monotonic()
        with self._lock:
            self._open[request] = _Connection(now, now + self.deadline_s)
        try:
            request.settimeout(self.socket_timeout_s)
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._done(request)
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._lock:
            held = self._open.pop(request, None) is not None
        if held:
            self._slots.release()

    def head_read(self, request: Any) -> bool:
        """The handler read the request head: from here on the connection is doing real work. False
        when the server hung up on it meanwhile (the head is cut short: nothing to serve)."""
        with self._lock:
            conn = self._open.get(request)
            if conn is None or conn.dropped:
                return False
            conn.reading = False
            return True

    def _evict_one(self) -> bool:
        """Drop the connection that has been sending its request head the longest (its thread sees
        the end of the stream and exits, freeing its slot); False when every one is past its head."""
        with self._lock:
            reading = [(c.started, sock, c) for sock, c in self._open.items() if c.reading and not c.dropped]
            if not reading:
                return False
            _, sock, conn = min(reading, key=lambda item: item[0])
            conn.dropped = True
        self.evicted += 1
        _hang_up(sock)
        return True

    def service_actions(self) -> None:
        """serve_forever calls this every poll interval: connections past their deadline are dropped."""
        now = time.monotonic()
        with self._lock:
            late = [(sock, c) for sock, c in self._open.items() if c.deadline < now and not c.dropped]
            for _, conn in late:
                conn.dropped = True
        for sock, _ in late:
            self.expired += 1
            _hang_up(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out, was dropped or went away: not worth a traceback on stderr."""
        log.debug("metrics port: connection from %s ended with an error", client_address, exc_info=True)


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes and probes are not news
        pass

    def parse_request(self) -> bool:
        ok = super().parse_request()
        server = self.server
        if isinstance(server, _ThreadingServer) and not server.head_read(self.connection):
            return False  # dropped while sending it: not served
        return ok


class HasRegistry(Protocol):
    """What MetricsServer serves: the service's Metrics, or the publisher's (anything with a registry)."""

    @property
    def registry(self) -> CollectorRegistry: ...


class MetricsServer:
    """/metrics, plus /healthz (liveness) and /readyz (readiness) when probes are given, on its own
    thread, off the event loop; a probe reads state the event loop keeps (no locks needed). At most
    `max_connections` handler threads; slow or silent clients are dropped (MAX_CONNECTIONS above)."""

    def __init__(
        self,
        metrics: HasRegistry,
        listen: str,
        probes: Mapping[str, Probe] | None = None,
        pages: Mapping[str, Page] | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._probes = dict(probes or {})
        self._pages = dict(pages or {})
        self._server = _ThreadingServer(
            (host.strip("[]"), int(port)),
            _QuietHandler,
            max_connections=max_connections,
            socket_timeout_s=socket_timeout_s,
            deadline_s=deadline_s,
        )
        self._server.set_app(self._app)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        path = environ.get("PATH_INFO", "")
        page = self._pages.get(path)
        if page is not None:
            return self._page(page, start_response)
        if path.startswith("/debug/"):  # a debug page that is not enabled
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return iter([b"not enabled\n"])
        probe = self._probes.get(path)
        if probe is None:
            return iter(self._metrics_app(environ, start_response))
        try:
            ok, reason = probe()
        except Exception as exc:  # a probe that fails says not ok, never a 500 with a traceback
            ok, reason = False, f"probe failed: {type(exc).__name__}"
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return iter([(reason + "\n").encode()])

    @staticmethod
    def _page(page: Page, start_response: Callable[..., Any]) -> Iterator[bytes]:
        try:
            status, content_type, body = page()
        except Exception as exc:  # never a traceback on the wire
            status, content_type, body = 500, "text/plain", f"page failed: {type(exc).__name__}\n".encode()
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}.get(status, "")
        start_response(f"{status} {reason}".strip(), [("Content-Type", content_type)])
        return iter([body])

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def server(self) -> _ThreadingServer:
        """The HTTP server (its counters: `refused`, `evicted`, `expired`; `open_connections()`)."""
        return self._server

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
