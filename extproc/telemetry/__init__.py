"""Telemetry: Prometheus metrics for routing decisions, errors and in-flight load."""

from extproc.telemetry.metrics import Metrics, MetricsServer

__all__ = ["Metrics", "MetricsServer"]
