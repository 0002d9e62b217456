"""The gRPC server: ext_proc + gRPC health on one port, /metrics on another, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config import ServiceConfig
from extproc.fleet import FleetView
from extproc.fleet.redis_feed import RedisFeed
from extproc.lifecycle import RequestLifecycle
from extproc.server.stream import ExternalProcessor
from extproc.settings import GIL_SWITCH_INTERVAL_S
from extproc.telemetry import Metrics, MetricsServer

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(slots=True)
class RunningService:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    lifecycle: RequestLifecycle
    metrics: Metrics
    metrics_server: MetricsServer | None
    feed: RedisFeed | None = None

    async def stop(self, grace: float) -> None:
        """Stop accepting streams, let open ones finish for up to `grace` seconds, then cancel them."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.feed is not None:
            await self.feed.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.lifecycle.config.tokenizers is not None:
            self.lifecycle.config.tokenizers.close()


async def start(config: ServiceConfig) -> RunningService:
    metrics = Metrics(config.pool.models(), config.pool.cluster_names())
    view = FleetView(config.pool) if config.fleet is not None else None
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
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(lifecycle), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(EXT_PROC_SERVICE, serving)
    metrics_server = MetricsServer(metrics, config.metrics_listen) if config.metrics_listen else None
    log.info(
        "ext_proc listening on %s (port %d), metrics on %s, %d clusters, models: %s",
        config.listen,
        port,
        config.metrics_listen or "off",
        len(config.pool.clusters),
        ", ".join(config.pool.models()) or "*",
    )
    return RunningService(server, port, health_servicer, lifecycle, metrics, metrics_server, feed)


async def serve(config: ServiceConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    running = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining open streams for up to %.0fs", config.shutdown_grace_s)
    await running.stop(config.shutdown_grace_s)
    log.info("stopped")
