"""Command line: `llm-extproc serve | check-config | publish | sim | simulate | demo | bench...`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from extproc import __version__


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
    _run(serve(config))
    return 0


def _check(args: argparse.Namespace) -> int:
    from extproc.config import load_config

    config = load_config(args.config)
    print(
        f"ok: {len(config.pool.clusters)} clusters, models {config.pool.models()}, "
        f"profile '{config.profile.name}'"
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


def _publish(args: argparse.Namespace) -> int:
    from extproc.publishers.publisher import Publisher, load_publisher_config

    config = load_publisher_config(
        args.config,
        envoy_admin=args.envoy_admin,
        redis_url=args.redis_url,
        redis_pool=args.pool,
        interval_s=args.interval,
        scrape_timeout_s=args.scrape_timeout,
        metrics_listen=args.metrics_listen,
    )
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
    _run(run_engines(args.host, args.port, delays, args.model, args.max_batch, profiles, args.time_scale))
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
        )
    )
    return 0 if all(p.get("big_504", 0) == 0 for p in report["phases"]) else 1


def _overhead(args: argparse.Namespace) -> int:
    from extproc.lab.bench.scenarios import run_overhead

    conc = tuple(int(c) for c in args.concurrency.split(","))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-extproc", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

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
    p.set_defaults(func=_serve)

    p = sub.add_parser("check-config", help="load and validate a config file, then exit")
    p.add_argument("--config", help="YAML config (default: $LLM_EXTPROC_CONFIG)")
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
    p.add_argument("--redis-url", help="e.g. redis://127.0.0.1:6379/0 (rediss:// for TLS)")
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

    p = sub.add_parser("sim", help="run simulated OpenAI-compatible engines (no GPU)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="first port; engine i listens on port+i")
    p.add_argument("--count", type=int, default=2, help="engines (when one delay is given)")
    p.add_argument("--model", default="sim-llama")
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
    p.set_defaults(func=_sim)

    p = sub.add_parser("demo", help="Envoy + llm-extproc + simulated engines, side by side with round robin")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rate", type=float, default=3.5, help="open-loop arrival rate, requests/s")
    p.add_argument("--tenants", type=int, default=64, help="tenants with their own 2000-token system prompt")
    p.add_argument("--out", default="out/demo")
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
        "with --local: run the live cells of a robustness grid (smoke | default) instead of one "
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
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="sim-llama")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO: time to first token, s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: time per output token, s")
    p.add_argument("--out", default="out/bench")
    p.set_defaults(func=_bench)

    p = sub.add_parser(
        "simulate", help="discrete-event mode: policies over many simulated engines, no sockets"
    )
    p.add_argument("--workload", default="shared-prefix")
    p.add_argument(
        "--policies",
        help=f"comma list (default: {','.join(SIMULATE_POLICIES)}; with --grid every one of "
        "those and sglang-cache-aware, vllm-router-cache-aware)",
    )
    _add_grid_options(
        p,
        "run a robustness grid instead of one workload: smoke | default | full "
        "(cells, capacity and targets: docs/benchmarks.md); writes grid-NAME.json and .md under --out",
    )
    p.add_argument("--profiles", default="a10g-llama3-8b", help="GPU profile(s), cycled over the engines")
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", action="append", help="workload parameter KEY=VALUE")
    p.add_argument("--publish-interval", type=float, default=1.0, help="seconds between fleet snapshots")
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--out", default="out/simulate", help="output folder (with --grid: default out/grid)")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("bench-overhead", help="latency/throughput through Envoy with vs without llm-extproc")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", default="1,8", help="comma list of closed-loop concurrencies")
    p.add_argument("--modes", default="BUFFERED,FULL_DUPLEX_STREAMED", help="ext_proc request body modes")
    p.add_argument("--out", default="out/overhead")
    p.set_defaults(func=_overhead)

    p = sub.add_parser(
        "bench-tokenization",
        help="what tokenization adds to a routing decision: tok/s, latency, multi-turn cache, loop stalls",
    )
    p.add_argument("--runs", type=int, default=20, help="prompts per size")
    p.add_argument("--out", default="out/tokenization")
    p.set_defaults(func=_tokenization_bench)

    p = sub.add_parser("bench-fleet", help="snapshot ingestion rate and decision latency vs fleet size")
    p.add_argument("--out", default="out/fleet")
    p.set_defaults(func=_fleet_bench)

    p = sub.add_parser(
        "bench-big-bodies",
        help="small requests' latency while clients send 15 MB bodies (Envoy + service + engines)",
    )
    p.add_argument("--kinds", default="text,image", help="big bodies: text (a long prompt), image (base64)")
    p.add_argument("--clients", type=int, default=8, help="concurrent big-body clients")
    p.add_argument("--size-mb", type=float, default=15.0, help="big body size, MB")
    p.add_argument("--seconds", type=float, default=15.0, help="small-request probe time per phase")
    p.add_argument("--rate", type=float, default=20.0, help="small requests per second (open loop)")
    p.add_argument("--service", help="YAML merged into the service config, e.g. 'bodies: {workers: 1}'")
    p.add_argument("--out", default="out/big-bodies")
    p.set_defaults(func=_big_bodies_bench)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"llm-extproc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
