"""`llm-extproc publish`: scrape the engines and publish fleet snapshots to Redis."""

from __future__ import annotations

import argparse
import asyncio

from extproc.cli.common import check_listen, run_async, warn_credentials_in_argv
from extproc.settings import ENV_REDIS_PASSWORD

DESCRIPTION = (
    "Scrape every engine's /health and /metrics on its own schedule and publish normalised fleet "
    "snapshots to Redis for the service replicas. Instances come from --config or from Envoy's admin "
    "API (clusters tagged with llm-extproc metadata)."
)


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "publish", help="scrape engine /metrics and publish fleet snapshots to Redis", description=DESCRIPTION
    )
    p.add_argument("--config", help="publisher YAML (instances, redis, interval_s, ...)")
    p.add_argument(
        "--envoy-admin", help="discover instances from Envoy's admin API, e.g. http://127.0.0.1:9901"
    )
    p.add_argument(
        "--redis-url",
        help="e.g. redis://127.0.0.1:6379/0 (rediss:// for TLS); without a password: the command "
        f"line is visible to every user of the host, set ${ENV_REDIS_PASSWORD} instead",
    )
    p.add_argument("--pool", help="pool name (Redis key prefix llm-extproc:<pool>)")
    p.add_argument("--interval", type=float, help="seconds between scrapes (default 0.5)")
    p.add_argument(
        "--scrape-timeout",
        type=float,
        metavar="SECONDS",
        help="deadline of one instance's scrape; below --interval (default min(2, 0.8 x interval))",
    )
    p.add_argument(
        "--metrics-listen", help="the publisher's own Prometheus /metrics, e.g. 127.0.0.1:9103 (default off)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.publishers import Publisher, load_publisher_config

    warn_credentials_in_argv("--redis-url", args.redis_url)
    config = load_publisher_config(
        args.config,
        envoy_admin=args.envoy_admin,
        redis_url=args.redis_url,
        redis_pool=args.pool,
        interval_s=args.interval,
        scrape_timeout_s=args.scrape_timeout,
        metrics_listen=args.metrics_listen,
    )
    if config.metrics_listen:
        check_listen(config.metrics_listen, "--metrics-listen")
    publisher = Publisher(config)

    async def publish_until_stopped() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await publisher.run(stop)

    run_async(publish_until_stopped())
    return 0
