"""`llm-extproc serve`: the ext_proc gRPC service (one process, or N under a supervisor)."""

from __future__ import annotations

import argparse

from extproc.cli.common import check_listen, run_async

DESCRIPTION = (
    "Run the ext_proc gRPC service that Envoy calls for every request: it parses the OpenAI request, "
    "picks an upstream and tells Envoy where to send it. Prometheus /metrics, /healthz and /readyz on "
    "--metrics-listen."
)


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the ext_proc gRPC service", description=DESCRIPTION)
    p.add_argument("--config", help="YAML config (default: $LLM_EXTPROC_CONFIG)")
    p.add_argument("--listen", help="gRPC listen address, e.g. 0.0.0.0:9002")
    p.add_argument("--metrics-listen", help="Prometheus /metrics address, e.g. 0.0.0.0:9090")
    p.add_argument("--max-body-bytes", type=int, help="largest request body routed (413 above)")
    p.add_argument(
        "--shutdown-announce",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, report NOT_SERVING but keep accepting streams this long, so Envoy's health "
        "check moves traffic first (default 6: the shipped health check, docs/operations.md)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="SECONDS",
        help="then let open streams finish for up to this long before cancelling them (default 30)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run N service processes (one core each) under a supervisor that forwards SIGTERM and "
        "restarts a worker that dies; worker i serves metrics on the metrics port + i",
    )
    p.add_argument(
        "--role",
        choices=("main", "bulk"),
        default="main",
        help="bulk: the process envoy.yaml's big-body route (content-length >= 1 MiB) sends ext_proc "
        "calls to, on the llm-extproc-bulk cluster's port (9004 in the shipped files); it runs at "
        "bodies.worker_nice and routes like any replica (docs/tuning.md, 'Big bodies')",
    )
    p.add_argument(
        "--worker-ports",
        choices=("shared", "consecutive"),
        default="shared",
        help="with --workers: all on the --listen port (SO_REUSEPORT), or worker i on port + i "
        "(list them in envoy.yaml; Envoy then balances streams; docs/tuning.md)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.config import load_config
    from extproc.server import serve

    config = load_config(
        args.config,
        listen=args.listen,
        metrics_listen=args.metrics_listen,
        max_body_bytes=args.max_body_bytes,
        shutdown_announce_s=args.shutdown_announce,
        shutdown_grace_s=args.shutdown_grace,
    )
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: at least 1")
    if args.workers > 1:
        return _serve_workers(args, config.listen, config.metrics_listen)
    check_listen(config.listen, "--listen")
    if config.metrics_listen:
        check_listen(config.metrics_listen, "--metrics-listen")
    run_async(serve(config, role=args.role))
    return 0


def _serve_workers(args: argparse.Namespace, listen: str, metrics_listen: str | None) -> int:
    """`serve --workers N`: check every address once, then supervise N `serve` processes."""
    from extproc.server.workers import Supervisor, offset_port, worker_commands

    if listen.endswith(":0") or (metrics_listen or "").endswith(":0"):
        raise ValueError("--workers needs fixed ports (workers share or offset them), not port 0")
    for i in range(args.workers):
        if i == 0 or args.worker_ports == "consecutive":
            check_listen(offset_port(listen, i), "--listen")
        if metrics_listen:
            check_listen(offset_port(metrics_listen, i), f"--metrics-listen (worker {i}: port + {i})")
    serve_args = [f"--log-level={args.log_level}", f"--log-format={args.log_format}", f"--role={args.role}"]
    for flag, value in (
        ("--config", args.config),
        ("--max-body-bytes", args.max_body_bytes),
        ("--shutdown-announce", args.shutdown_announce),
        ("--shutdown-grace", args.shutdown_grace),
    ):
        if value is not None:
            serve_args.append(f"{flag}={value}")
    commands = worker_commands(serve_args, args.workers, listen, metrics_listen, args.worker_ports)
    return Supervisor(commands).run()
