"""Command line: `llm-extproc serve | check-config | init | publish | doctor`; the lab distribution
(llm-extproc-lab) adds `sim | simulate | demo | bench...`."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import sys
from collections.abc import Coroutine
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeVar

from extproc import __version__
from extproc.settings import ENV_REDIS_PASSWORD
from extproc.telemetry.logs import LOG_FORMATS, LOG_LEVELS, setup_logging

log = logging.getLogger("extproc.cli")


def _serve(args: argparse.Namespace) -> int:
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
    _run(serve(config, role=args.role))
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


def _check(args: argparse.Namespace) -> int:
    from extproc.config import load_config

    config = load_config(args.config)
    if args.envoy_config:
        import yaml

        from extproc.doctor import route_metadata_problems

        envoy_cfg = yaml.safe_load(Path(args.envoy_config).read_text())
        if not isinstance(envoy_cfg, dict):
            raise ValueError(f"{args.envoy_config}: not a YAML mapping")
        problems = route_metadata_problems(config, envoy_cfg)
        if problems:
            raise ValueError(f"{args.envoy_config}: route metadata: " + "; ".join(problems))
    print(
        f"ok: {len(config.pool.clusters)} clusters, models {config.pool.models()}, "
        f"profile '{config.profile.name}'"
        + (f", route metadata in {args.envoy_config} valid" if args.envoy_config else "")
    )
    return 0


# What `init` writes: an Envoy config and the service YAML that agree with it (cluster names, ports,
# header names), plus the endpoint-picker pair. The user edits addresses and model names.
INIT_FILES = ("envoy.yaml", "llm-extproc.yaml", "endpoint-picker.yaml", "llm-extproc-endpoint.yaml")


def _init(args: argparse.Namespace) -> int:
    from extproc.settings import shipped_configs

    target = Path(args.dir)
    source = shipped_configs()
    clashes = [name for name in INIT_FILES if (target / name).exists()]
    if clashes and not args.force:
        raise ValueError(f"{target}: would overwrite {clashes}; pass --force to replace them")
    target.mkdir(parents=True, exist_ok=True)
    for name in INIT_FILES:
        (target / name).write_text((source / name).read_text())
    print(f"wrote {', '.join(INIT_FILES)} to {target}/")
    print(f"next: llm-extproc check-config --config {target / 'llm-extproc.yaml'}")
    print(f"      envoy --mode validate -c {target / 'envoy.yaml'}")
    return 0


def warn_credentials_in_argv(flag: str, url: str | None) -> bool:
    """Log a warning when a Redis URL given on the command line carries credentials (`user:pw@`):
    every user of the host reads a process's arguments (`ps`, /proc/<pid>/cmdline). True if it did.
    The password belongs in $LLM_EXTPROC_REDIS_PASSWORD, which is used in place of the URL's."""
    if not url:
        return False
    rest = url.partition("://")[2] or url
    if "@" not in rest:
        return False
    log.warning(
        "%s carries credentials: every user of this host can read them in the process list "
        "(/proc/<pid>/cmdline); pass the URL without them and the password in $%s",
        flag,
        ENV_REDIS_PASSWORD,
    )
    return True


def _publish(args: argparse.Namespace) -> int:
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

    async def run() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await publisher.run(stop)

    _run(run())
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from extproc.doctor import DoctorOptions, report, run_doctor_until

    warn_credentials_in_argv("--redis", args.redis)
    opts = DoctorOptions(
        config=args.config,
        envoy_admin=args.envoy_admin,
        envoy_config=args.envoy_config,
        redis_url=args.redis,
        timeout_s=args.timeout,
        probe_engines=args.probe_engines,
        engine_api_key=os.environ.get("LLM_EXTPROC_ENGINE_API_KEY") or None,
        service_metrics=args.service_metrics,
    )
    text, status = report(_run(run_doctor_until(opts, args.wait)))
    print(text)
    return status


T = TypeVar("T")


# Commands the lab distribution (lab/, llm-extproc-lab) adds through the entry point group below;
# without it they are listed and say how to get them.
COMMANDS_GROUP = "llm_extproc.commands"
LAB_COMMANDS = {
    "sim": "simulated OpenAI-compatible engines",
    "demo": "Envoy + llm-extproc + simulated engines, side by side with round robin",
    "bench": "a named workload against OpenAI-compatible targets, side by side",
    "simulate": "the discrete-event mode",
    "bench-overhead": "latency/throughput through Envoy with vs without llm-extproc",
    "bench-tokenization": "tokenization on the request path",
    "bench-fleet": "snapshot ingestion rate and decision latency vs fleet size",
    "bench-big-bodies": "small requests' latency while clients send 15 MB bodies",
}


def _lab_missing(args: argparse.Namespace) -> int:
    raise ValueError(
        f"`{args.command}` is a command of the lab, which is not installed: "
        "pip install llm-extproc-lab (from a checkout: pip install -e ./lab)"
    )


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end on uvloop where installed (the service's event loop)."""
    return _run(coro)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help when X says something: not None, not a switch's False,
    and not when the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
            or isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


# A line or two on what each command is for (its `--help` page); the one-line `help` is the list entry.
DESCRIPTIONS = {
    "serve": "Run the ext_proc gRPC service that Envoy calls for every request: it parses the OpenAI "
    "request, picks an upstream and tells Envoy where to send it. Prometheus /metrics, /healthz and "
    "/readyz on --metrics-listen.",
    "check-config": "Load a service YAML exactly as `serve` would, report its clusters, models and "
    "profile, and exit (non-zero with the reason when it is invalid).",
    "init": "Write envoy.yaml and llm-extproc.yaml (plus the endpoint-picker pair) that agree on cluster "
    "names, ports and headers, to edit for your own model servers.",
    "publish": "Scrape every engine's /health and /metrics on its own schedule and publish normalised "
    "fleet snapshots to Redis for the service replicas. Instances come from --config or from Envoy's "
    "admin API (clusters tagged with llm-extproc metadata).",
    "doctor": "Check a running setup: Envoy admin reachable and its llm-extproc cluster healthy, Redis "
    "reachable, a fresh snapshot per upstream, and envoy.yaml's clusters matching the service YAML. "
    "One line per check; exits 1 when any fails.",
}

LOG_OPTION_DESTS = ("log_level", "log_format")


def _add_log_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--log-level and --log-format, before the command (top) and after it (each command, where the
    defaults are suppressed so a value given before the command survives)."""
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO" if top else argparse.SUPPRESS,
        help="log threshold, any case (default: INFO)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text" if top else argparse.SUPPRESS,
        help="text lines, or one JSON object per line: ts, level, logger, message, extra fields "
        "(default: text)",
    )


def _finish_subcommands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every command: a description, defaults shown in --help, and the global log flags."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        p.formatter_class = HelpFormatter
        if not p.description:
            p.description = DESCRIPTIONS.get(name) or helps.get(name)
        if not any(a.dest == "log_level" for a in p._actions):
            _add_log_options(p, top=False)


def check_listen(address: str, flag: str) -> None:
    """Fail in one line, before anything starts, when `address` (host:port) cannot be listened on here:
    a host that does not resolve, an address that is not this machine's, or a port already taken.
    SO_REUSEPORT is set as the gRPC server sets it, so only what would really clash is refused."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} {address!r}: expected host:port with a port 0-65535")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{flag} {address}: cannot resolve host {host!r} ({reason})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    f"{flag} {address}: port {port} is already in use (another llm-extproc, engine or "
                    "Envoy?); stop it or pick a free port"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise OSError(
                    f"{flag} {address}: {host} is not an address of this machine; use 127.0.0.1, "
                    "0.0.0.0 or one of its own IPs"
                ) from None
            if exc.errno == errno.EACCES:
                raise OSError(f"{flag} {address}: port {port} needs privileges; use a port >= 1024") from None
            raise OSError(f"{flag} {address}: cannot listen ({exc.strerror or exc})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-extproc", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=__version__)
    _add_log_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the ext_proc gRPC service")
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
    p.set_defaults(func=_serve)

    p = sub.add_parser("check-config", help="load and validate a config file, then exit")
    p.add_argument("--config", help="YAML config (default: $LLM_EXTPROC_CONFIG)")
    p.add_argument(
        "--envoy-config",
        help="also check the ext_proc metadata (profiles, priority caps, objectives) of an envoy.yaml",
    )
    p.set_defaults(func=_check)

    p = sub.add_parser(
        "init", help="write an Envoy config and a service YAML that agree, to edit for your own servers"
    )
    p.add_argument("dir", help="folder to write into (created if missing)")
    p.add_argument("--force", action="store_true", help="replace files that already exist")
    p.set_defaults(func=_init)

    p = sub.add_parser("publish", help="scrape engine /metrics and publish fleet snapshots to Redis")
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
    p.add_argument("--interval", type=float, help="seconds between scrapes (default 1)")
    p.add_argument(
        "--scrape-timeout",
        type=float,
        metavar="SECONDS",
        help="deadline of one instance's scrape; below --interval (default min(2, 0.8 x interval))",
    )
    p.add_argument(
        "--metrics-listen", help="the publisher's own Prometheus /metrics, e.g. 127.0.0.1:9103 (default off)"
    )
    p.set_defaults(func=_publish)

    p = sub.add_parser(
        "doctor", help="check a running setup (Envoy, service, Redis, snapshots) and say what to fix"
    )
    p.add_argument(
        "--config", help="the service YAML the running service uses (default: $LLM_EXTPROC_CONFIG)"
    )
    p.add_argument("--envoy-admin", help="Envoy's admin API, e.g. http://127.0.0.1:9901")
    p.add_argument(
        "--envoy-config", help="an envoy.yaml to compare clusters with (default: Envoy's live config_dump)"
    )
    p.add_argument(
        "--redis",
        help="Redis URL holding the snapshots (default: the YAML's fleet.url); without a password: "
        f"the command line is visible to every user of the host, set ${ENV_REDIS_PASSWORD} instead",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds allowed for each part's answers")
    p.add_argument(
        "--service-metrics",
        help="the service's /metrics URL, for its calibration against the engines (default: the YAML's "
        "metrics_listen on loopback)",
    )
    p.add_argument(
        "--probe-engines",
        action="store_true",
        help="with engine_priority: send each engine it writes to (at its snapshot's address) a "
        "one-token completion carrying a non-zero priority, to find engines that refuse it (vLLM not "
        "started with --scheduling-policy priority); bearer token from $LLM_EXTPROC_ENGINE_API_KEY",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="repeat the checks until all pass or this long has gone by (for scripts that just started "
        "the parts)",
    )
    p.set_defaults(func=_doctor)

    for command in entry_points(group=COMMANDS_GROUP):  # the lab's commands, when it is installed
        command.load()(sub)
    for name, what in LAB_COMMANDS.items():
        if name not in sub.choices:
            p = sub.add_parser(name, help=f"{what} (needs the lab: pip install llm-extproc-lab)")
            p.set_defaults(func=_lab_missing)
    _finish_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"llm-extproc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
