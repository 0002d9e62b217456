"""Command line: `llm-extproc serve | check-config | publish | sim | simulate | demo | bench...`."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import sys
from collections.abc import Coroutine
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
    from extproc.publishers.publisher import Publisher, load_publisher_config

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


def _sim(args: argparse.Namespace) -> int:
    from extproc.lab.engines.profiles import PROFILES
    from extproc.lab.engines.server import run_engines

    profiles = None
    if args.profile:
        names = [x.strip() for x in args.profile.split(",") if x.strip()]
        unknown = [n for n in names if n not in PROFILES]
        if unknown:
            raise ValueError(f"unknown profile(s) {unknown}; known: {sorted(PROFILES)}")
        if len(names) == 1:
            names = names * args.count
        profiles = [PROFILES[n] for n in names]
    delays = [float(x) / 1000.0 for x in str(args.token_delay_ms).split(",") if x.strip()]
    if len(delays) == 1:
        delays = delays * (len(profiles) if profiles else args.count)
    if args.port:  # 0: any free ports
        for i in range(len(profiles) if profiles else len(delays)):
            check_listen(f"{args.host}:{args.port + i}", "--host/--port" if i == 0 else f"engine {i}")
    if args.priority_preemption_threshold is not None and not profiles:
        raise ValueError("--priority-preemption-threshold needs --profile (the engine model preempts)")
    if args.kv_events_port is not None and not profiles:
        raise ValueError("--kv-events-port needs --profile (only model-driven engines have a KV cache)")
    if args.token_scale != 1.0 and not profiles:
        raise ValueError("--token-scale needs --profile (only model-driven engines tokenize)")
    if not args.token_scale > 0:
        raise ValueError("--token-scale must be positive")
    _run(
        run_engines(
            args.host,
            args.port,
            delays,
            args.model,
            args.max_batch,
            profiles,
            args.time_scale,
            kv_events_port=args.kv_events_port,
            kv_events_topic=args.kv_events_topic,
            scheduling_policy=args.scheduling_policy,
            preemption_threshold=args.priority_preemption_threshold,
            token_scale=args.token_scale,
        )
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from extproc.lab.bench.scenarios import run_demo

    return _run(
        run_demo(requests=args.requests, rate=args.rate, tenants=args.tenants, out_dir=Path(args.out))
    )


def _params(items: list[str] | None) -> dict[str, object]:
    """--param key=value pairs for a workload; numbers become numbers."""
    out: dict[str, object] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--param must be KEY=VALUE, got {item!r}")
        value: object = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        out[key.replace("-", "_")] = value
    return out


def _bench(args: argparse.Namespace) -> int:
    from extproc.lab.bench.report import Slo
    from extproc.lab.bench.scenarios import Target, run_bench, run_live_bench

    slo = Slo(args.slo_ttft, args.slo_tpot)
    if args.grid:
        if not args.local:
            raise ValueError("--grid runs on local simulated engines: add --local")
        from extproc.lab.bench.grid_live import run_live_grid
        from extproc.lab.discrete_event.grid import calibrate

        count_scale = args.count_scale

        def calibrate_cell(cell: Any) -> Any:
            return calibrate(cell, seed=args.seed, count_scale=count_scale)

        results = _run(
            run_live_grid(
                args.grid,
                calibrate=calibrate_cell,
                policies=[p.strip() for p in args.policies.split(",") if p.strip()],
                cells=[c.strip() for c in args.cells.split(",") if c.strip()] if args.cells else None,
                time_scale=args.time_scale or 2.0,
                out_dir=Path(args.out if args.out != "out/bench" else "out/grid-live"),
            )
        )
        return 0 if all(r.targets["errors"] != "MISS" for r in results) else 1
    if args.local:
        reports = _run(
            run_live_bench(
                workload=args.workload,
                policies=[p.strip() for p in args.policies.split(",") if p.strip()],
                profiles=[p.strip() for p in args.profiles.split(",") if p.strip()],
                rate=args.rate,
                count=args.count,
                seed=args.seed,
                slo=slo,
                warmup=args.warmup,
                time_scale=args.time_scale or 1.0,
                params=_params(args.param),
                out_dir=Path(args.out),
            )
        )
        return 0 if all(r.errors == 0 for r in reports) else 1
    if not args.target:
        raise ValueError("give --target NAME=URL (repeatable) or --local")
    targets = []
    for spec in args.target:
        name, sep, url = spec.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise ValueError(f"--target must be NAME=URL (http...), got {spec!r}")
        targets.append(Target(name, url))
    reports = _run(
        run_bench(
            workload=args.workload,
            targets=targets,
            rate=args.rate,
            count=args.count,
            seed=args.seed,
            model=args.model,
            slo=slo,
            warmup=args.warmup,
            out_dir=Path(args.out),
            params=_params(args.param),
        )
    )
    return 0 if all(r.errors == 0 for r in reports) else 1


SIMULATE_POLICIES = ("llm-extproc", "round-robin", "least-request", "exact-ttft", "clairvoyant-affinity")


def _simulate(args: argparse.Namespace) -> int:
    from extproc.lab.bench.report import Slo
    from extproc.lab.discrete_event.simulation import POLICIES, run_simulations

    if args.policies is None:  # a grid runs every policy; one workload, the original five
        args.policies = ",".join(POLICIES if args.grid else SIMULATE_POLICIES)
        if args.grid == "pressure":  # with and without the engines' tokenizer, in every cell
            args.policies += ",llm-extproc-token-ids"
    if args.grid:
        from extproc.lab.discrete_event.grid import run_des_grid

        results = run_des_grid(
            args.grid,
            policies=[p.strip() for p in args.policies.split(",") if p.strip()],
            cells=[c.strip() for c in args.cells.split(",") if c.strip()] if args.cells else None,
            seed=args.seed,
            count_scale=args.count_scale,
            publish_interval_s=args.publish_interval,
            out_dir=Path(args.out if args.out != "out/simulate" else "out/grid"),
        )
        return 0 if all(r.targets["errors"] != "MISS" for r in results) else 1
    return run_simulations(
        workload=args.workload,
        policies=[p.strip() for p in args.policies.split(",") if p.strip()],
        profiles=[p.strip() for p in args.profiles.split(",") if p.strip()],
        engines=args.engines,
        rate=args.rate,
        count=args.count,
        seed=args.seed,
        slo=Slo(args.slo_ttft, args.slo_tpot),
        publish_interval_s=args.publish_interval,
        params=_params(args.param),
        out_dir=Path(args.out),
    )


def _tokenization_bench(args: argparse.Namespace) -> int:
    from extproc.lab.bench.tokenization import run_tokenization_bench

    return _run(run_tokenization_bench(Path(args.out), runs=args.runs))


def _fleet_bench(args: argparse.Namespace) -> int:
    from extproc.lab.bench.fleet_state import run_fleet_bench

    return _run(run_fleet_bench(Path(args.out)))


def _big_bodies_bench(args: argparse.Namespace) -> int:
    import yaml

    from extproc.lab.bench.big_bodies import run_big_bodies_bench

    overrides = yaml.safe_load(args.service) if args.service else None
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError("--service must be a YAML mapping")
    report = _run(
        run_big_bodies_bench(
            Path(args.out),
            kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
            clients=args.clients,
            size_mb=args.size_mb,
            seconds=args.seconds,
            rate=args.rate,
            service=overrides,
            layouts=tuple(x.strip() for x in args.layouts.split(",") if x.strip()),
        )
    )
    return 0 if all(p.get("big_504", 0) == 0 for p in report["phases"]) else 1


def _overhead(args: argparse.Namespace) -> int:
    from extproc.lab.bench.scenarios import run_overhead

    conc = tuple(int(c) for c in args.concurrency.split(","))
    if args.workers:
        from extproc.lab.bench.workers_overhead import run_workers_overhead

        return _run(
            run_workers_overhead(
                workers=tuple(int(w) for w in args.workers.split(",")),
                requests=args.requests,
                concurrency=conc[-1],
                worker_ports=args.worker_ports,
                same_prompt=args.same_prompt,
                out_dir=Path(args.out if args.out != "out/overhead" else "out/overhead-workers"),
            )
        )
    modes = tuple(m.strip().upper() for m in args.modes.split(",") if m.strip())
    return _run(run_overhead(requests=args.requests, concurrency=conc, modes=modes, out_dir=Path(args.out)))


T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _add_grid_options(
    p: argparse.ArgumentParser, grid_help: str, *, count_scale: float = 1.0, count_scale_note: str = ""
) -> None:
    """--grid, --cells and --count-scale, shared by `bench --local --grid` and `simulate --grid`."""
    p.add_argument("--grid", help=grid_help)
    p.add_argument("--cells", help="with --grid: only these cells of the grid (comma list of names)")
    note = f" (default {count_scale:g}: {count_scale_note})" if count_scale_note else ""
    p.add_argument(
        "--count-scale",
        type=float,
        default=count_scale,
        help=f"with --grid: multiply every cell's request count{note}",
    )


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
    "sim": "Run simulated OpenAI-compatible engines (chat, completions, embeddings, models, vLLM-named "
    "/metrics) on consecutive ports: a stand-in for GPU servers.",
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

    p = sub.add_parser("sim", help="run simulated OpenAI-compatible engines (no GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address the engines listen on")
    p.add_argument("--port", type=int, default=8001, help="first port; engine i listens on port+i")
    p.add_argument("--count", type=int, default=2, help="engines (when one delay is given)")
    p.add_argument("--model", default="sim-llama", help="model name the engines serve and report")
    p.add_argument(
        "--token-delay-ms", default="5", help="time per output token; a comma list gives one engine per value"
    )
    p.add_argument(
        "--max-batch", type=int, default=8, help="concurrent generations per engine (0: unlimited)"
    )
    p.add_argument(
        "--profile",
        help="engine model profile(s), comma list (h100-llama3-8b, a10g-llama3-8b, test): batching, KV cache "
        "with prefix reuse and preemption instead of a fixed cost per token",
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="virtual seconds per real second (model only)"
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        help="publish vLLM-format KV-cache events (ZMQ PUB) on this port + i for engine i (0: any free "
        "port; needs --profile); `llm-extproc publish` subscribes with `kv_events:` per instance",
    )
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic of the KV events (vLLM's default: '')")
    p.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="with --profile: the engines count this many tokens per token of the built-in tokenizer "
        "(~4 bytes each): e.g. 0.57 for an engine whose tokens are whole words, 2 for one that counts "
        "character pairs; a router's bytes/4 estimate then differs from the engines' count",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="vLLM's --scheduling-policy: 'priority' serves the body's `priority` field lower-first "
        "(the service's `engine_priority:` sets it); 'fcfs' refuses a non-zero priority with 400",
    )
    p.add_argument(
        "--priority-preemption-threshold",
        type=int,
        help="with --scheduling-policy priority and --profile: a waiting request that finds no slot "
        "or KV room preempts running ones more than this much lower in priority (SGLang's rule; "
        "default: never, as vLLM)",
    )
    p.set_defaults(func=_sim)

    p = sub.add_parser("demo", help="Envoy + llm-extproc + simulated engines, side by side with round robin")
    p.add_argument("--requests", type=int, default=150, help="timed requests per policy")
    p.add_argument("--rate", type=float, default=3.5, help="open-loop arrival rate, requests/s")
    p.add_argument("--tenants", type=int, default=64, help="tenants with their own 2000-token system prompt")
    p.add_argument("--out", default="out/demo", help="folder for the report, plots and logs")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="run a named workload against OpenAI-compatible targets, side by side")
    p.add_argument(
        "--workload", default="shared-prefix", help="shared-prefix | multi-turn | long-context | bursty"
    )
    p.add_argument("--target", action="append", help="NAME=BASE_URL, repeatable (or --local)")
    p.add_argument(
        "--local", action="store_true", help="start simulated engines and each policy's router here"
    )
    p.add_argument(
        "--policies",
        default=",".join(
            (
                "llm-extproc",
                "envoy-round-robin",
                "envoy-least-request",
                "sglang-cache-aware",
                "vllm-router-cache-aware",
            )
        ),
        help="with --local (a peer router that is not installed is reported as skipped)",
    )
    _add_grid_options(
        p,
        "with --local: run the live cells of a robustness grid (smoke | default | pressure) instead of one "
        "workload; writes grid-live-NAME.json and .md under --out (default out/grid-live)",
        count_scale=0.25,
        count_scale_note="live runs cost real time",
    )
    p.add_argument(
        "--profiles",
        default="a10g-llama3-8b,a10g-llama3-8b,a10g-llama3-8b,a10g-llama3-8b",
        help="with --local: one simulated engine per GPU profile",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        help="with --local: engine speed-up (default 1; with --grid 2, arrivals sped up alike and "
        "latencies reported in engine time)",
    )
    p.add_argument("--param", action="append", help="workload parameter KEY=VALUE, e.g. tenants=96")
    p.add_argument("--rate", type=float, default=5.0, help="mean arrival rate, requests/s (open loop)")
    p.add_argument("--count", type=int, default=200, help="timed requests (after the warm-up)")
    p.add_argument("--warmup", type=int, default=10, help="untimed requests sent first")
    p.add_argument("--seed", type=int, default=0, help="workload random seed")
    p.add_argument("--model", default="sim-llama", help="model name put in the requests")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO: time to first token, s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: time per output token, s")
    p.add_argument("--out", default="out/bench", help="folder for reports and plots")
    p.set_defaults(func=_bench)

    p = sub.add_parser(
        "simulate", help="discrete-event mode: policies over many simulated engines, no sockets"
    )
    p.add_argument("--workload", default="shared-prefix", help="named workload (as for bench)")
    p.add_argument(
        "--policies",
        help=f"comma list (default: {','.join(SIMULATE_POLICIES)}; with --grid every one of "
        "those and sglang-cache-aware, vllm-router-cache-aware). Also llm-extproc-kv-events (with the "
        "engines' KV events and token ids) and llm-extproc-token-ids (token ids alone), which a grid "
        "compares with llm-extproc in its markdown",
    )
    _add_grid_options(
        p,
        "run a robustness grid instead of one workload: smoke | default | full | report | pressure "
        "(cells, capacity and targets: docs/benchmarks.md); writes grid-NAME.json and .md under --out",
    )
    p.add_argument("--profiles", default="a10g-llama3-8b", help="GPU profile(s), cycled over the engines")
    p.add_argument("--engines", type=int, default=16, help="simulated engines")
    p.add_argument("--rate", type=float, default=20.0, help="mean arrival rate, requests/s")
    p.add_argument("--count", type=int, default=2000, help="requests")
    p.add_argument("--seed", type=int, default=0, help="workload random seed")
    p.add_argument("--param", action="append", help="workload parameter KEY=VALUE")
    p.add_argument("--publish-interval", type=float, default=1.0, help="seconds between fleet snapshots")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO: time to first token, s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: time per output token, s")
    p.add_argument("--out", default="out/simulate", help="output folder (with --grid: default out/grid)")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("bench-overhead", help="latency/throughput through Envoy with vs without llm-extproc")
    p.add_argument("--requests", type=int, default=400, help="requests per mode and concurrency")
    p.add_argument("--concurrency", default="1,8", help="comma list of closed-loop concurrencies")
    p.add_argument("--modes", default="BUFFERED,FULL_DUPLEX_STREAMED", help="ext_proc request body modes")
    p.add_argument("--out", default="out/overhead", help="output folder")
    p.add_argument(
        "--workers",
        metavar="N,N",
        help="instead: `serve --workers N` for each N (Redis + publisher, ~1k-token chat prompts, "
        "the last --concurrency) against Envoy direct, with CPU per routed request",
    )
    p.add_argument(
        "--worker-ports",
        choices=("shared", "consecutive"),
        default="consecutive",
        help="with --workers: one SO_REUSEPORT port, or port + i per worker listed in envoy.yaml",
    )
    p.add_argument(
        "--same-prompt",
        action="store_true",
        help="with --workers: send one prompt repeatedly (the token cache serves it) instead of a "
        "different ~1k-token user turn per request",
    )
    p.set_defaults(func=_overhead)

    p = sub.add_parser(
        "bench-tokenization",
        help="what tokenization adds to a routing decision: tok/s, latency, multi-turn cache, loop stalls",
    )
    p.add_argument("--runs", type=int, default=20, help="prompts per size")
    p.add_argument("--out", default="out/tokenization", help="output folder")
    p.set_defaults(func=_tokenization_bench)

    p = sub.add_parser("bench-fleet", help="snapshot ingestion rate and decision latency vs fleet size")
    p.add_argument("--out", default="out/fleet", help="output folder")
    p.set_defaults(func=_fleet_bench)

    p = sub.add_parser(
        "bench-big-bodies",
        help="small requests' latency while clients send 15 MB bodies (Envoy + service + engines)",
    )
    p.add_argument(
        "--kinds",
        default="text,image",
        help="big bodies: text (a long prompt), image (base64), messages (hostile: tiny messages, chunked)",
    )
    p.add_argument(
        "--layouts",
        default="single,bulk",
        help="single: one service process; bulk: big bodies (>= 1 MiB) to a second `serve --role bulk` "
        "process (envoy.yaml's big-body route); each runs its own phases, in this run",
    )
    p.add_argument("--clients", type=int, default=8, help="concurrent big-body clients")
    p.add_argument("--size-mb", type=float, default=15.0, help="big body size, MB")
    p.add_argument("--seconds", type=float, default=15.0, help="small-request probe time per phase")
    p.add_argument("--rate", type=float, default=20.0, help="small requests per second (open loop)")
    p.add_argument("--service", help="YAML merged into the service config, e.g. 'bodies: {workers: 1}'")
    p.add_argument("--out", default="out/big-bodies", help="output folder")
    p.set_defaults(func=_big_bodies_bench)

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
