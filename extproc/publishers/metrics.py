"""The publisher's own Prometheus metrics: one registry per Publisher (tests run several in one
process), served on `metrics_listen` when configured. They answer the operator's questions about the
publisher itself: is every instance being scraped, which engine sends values we refuse, and how late
do snapshots reach Redis.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.telemetry.metrics import MetricsServer

# Scrape + write of one instance: milliseconds when healthy, up to the scrape timeout when not.
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


class PublisherMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.scrapes = Counter(
            "llm_extproc_publisher_scrapes",
            "Scrapes per instance by outcome: ok, timeout, unreachable, health_not_ok, metrics_error, "
            "metrics_too_large (the page exceeds max_metrics_bytes), redirect (a 3xx, not followed), "
            "parse_timeout (the page could not be parsed within the scrape deadline), "
            "no_load_signal (metrics answered but nothing says how busy the engine is), error (a "
            "publisher bug or unexpected library error; the instance's task carries on).",
            ["upstream", "outcome"],
            registry=self.registry,
        )
        self.rejected_values = Counter(
            "llm_extproc_publisher_rejected_values",
            "Engine values left out of a snapshot (the field is published as unknown), by field and "
            "reason: nan, infinite, negative, not_a_number, fractional, too_large, above_total, ...",
            ["upstream", "field", "reason"],
            registry=self.registry,
        )
        self.publishes = Counter(
            "llm_extproc_publisher_publishes",
            "Snapshot writes to Redis (SET + PUBLISH) by outcome: ok or failed.",
            ["outcome"],
            registry=self.registry,
        )
        self.publish_lag = Histogram(
            "llm_extproc_publisher_publish_lag_seconds",
            "From an instance's scheduled tick to its snapshot written in Redis (scrape + write).",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        self.last_publish = Gauge(
            "llm_extproc_publisher_last_publish_timestamp_seconds",
            "Unix time of the last snapshot written per instance (alert when it stops moving).",
            ["upstream"],
            registry=self.registry,
        )
        self.instances = Gauge(
            "llm_extproc_publisher_instances",
            "Instances with a running scrape-and-publish task.",
            registry=self.registry,
        )
        self.kv_events = Counter(
            "llm_extproc_publisher_kv_events",
            "KV-cache events from engines (publishers/kv_events.py) per instance: events (received and "
            "applied), gaps (sequence numbers skipped: mapping dropped, the set a lower bound), restarts "
            "(the sequence went back: a new engine process), disconnects (the engine's socket dropped: "
            "the set unknown until its next batch), bad (undecodable payloads), "
            "redis_errors (index updates not written).",
            ["upstream", "kind"],
            registry=self.registry,
        )
        self.kv_index_blocks = Gauge(
            "llm_extproc_publisher_kv_index_blocks",
            "Prefix-index blocks each instance's engine holds, as mapped from its KV events.",
            ["upstream"],
            registry=self.registry,
        )
        self._series: dict[str, set[tuple[str, ...]]] = {}  # upstream -> labelled series to drop

    def scrape(self, upstream: str, outcome: str) -> None:
        self.scrapes.labels(upstream=upstream, outcome=outcome).inc()
        self._series.setdefault(upstream, set()).add(("scrapes", outcome))

    def reject(self, upstream: str, field: str, reason: str) -> None:
        self.rejected_values.labels(upstream=upstream, field=field, reason=reason).inc()
        self._series.setdefault(upstream, set()).add(("rejected", field, reason))

    def published(self, upstream: str, ok: bool, lag_s: float, at: float) -> None:
        self.publishes.labels(outcome="ok" if ok else "failed").inc()
        if ok:
            self.publish_lag.observe(max(0.0, lag_s))
            self.last_publish.labels(upstream=upstream).set(at)
            self._series.setdefault(upstream, set()).add(("last",))

    def kv_event(self, upstream: str, kind: str, n: int = 1) -> None:
        self.kv_events.labels(upstream=upstream, kind=kind).inc(n)
        self._series.setdefault(upstream, set()).add(("kv", kind))

    def kv_index(self, upstream: str, blocks: int) -> None:
        self.kv_index_blocks.labels(upstream=upstream).set(blocks)
        self._series.setdefault(upstream, set()).add(("kv_index",))

    def forget(self, upstream: str) -> None:
        """Drop the series of an instance discovery no longer lists (bounded cardinality under churn)."""
        for series in self._series.pop(upstream, set()):
            if series[0] == "scrapes":
                self.scrapes.remove(upstream, series[1])
            elif series[0] == "rejected":
                self.rejected_values.remove(upstream, series[1], series[2])
            elif series[0] == "kv":
                self.kv_events.remove(upstream, series[1])
            elif series[0] == "kv_index":
                self.kv_index_blocks.remove(upstream)
            else:
                self.last_publish.remove(upstream)

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0 when absent): for tests and logs."""
        return self.registry.get_sample_value(name, labels) or 0.0


class MetricsEndpoint:
    """GET /metrics for the publisher's registry, on the service's metrics server (its own thread,
    bounded threads, slow clients dropped: telemetry.MetricsServer)."""

    def __init__(self, metrics: PublisherMetrics, listen: str) -> None:
        self._server = MetricsServer(metrics, listen)

    @property
    def port(self) -> int:
        return self._server.port

    def close(self) -> None:
        self._server.close()
