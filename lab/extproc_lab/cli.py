"""The lab's commands, added to `llm-extproc` when this distribution is installed (entry point group
`llm_extproc.commands`): sim, demo, bench, simulate, bench-overhead, bench-tokenization, bench-fleet,
bench-big-bodies."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from extproc.cli import check_listen
from extproc.cli import run_async as _run

DESCRIPTIONS = {
    "sim": "Run simulated OpenAI-compatible engines (chat, completions, embeddings, models, vLLM-named "
    "/metrics) on consecutive ports: a stand-in for GPU servers.",
}


def _sim(args: argparse.Namespace) -> int:
    from extproc_lab.engines.profiles import PROFILES
    from extproc_lab.engines.server import run_engines

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
    from extproc_lab.bench.scenarios import run_demo

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
    from extproc_lab.bench.report import Slo
    from extproc_lab.bench.scenarios import Target, run_bench, run_live_bench

    slo = Slo(args.slo_ttft, args.slo_tpot)
    if args.grid:
        if not args.local:
            raise ValueError("--grid runs on local simulated engines: add --local")
        from extproc_lab.bench.grid_live import run_live_grid
        from extproc_lab.discrete_event.grid import calibrate

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
    from extproc_lab.bench.report import Slo
    from extproc_lab.discrete_event.simulation import POLICIES, run_simulations

    if args.policies is None:  # a grid runs every policy; one workload, the original five
        args.policies = ",".join(POLICIES if args.grid else SIMULATE_POLICIES)
        if args.grid == "pressure":  # with and without the engines' tokenizer, in every cell
            args.policies += ",llm-extproc-token-ids"
    if args.grid:
        from extproc_lab.discrete_event.grid import run_des_grid

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
    from extproc_lab.bench.tokenization import run_tokenization_bench

    return _run(run_tokenization_bench(Path(args.out), runs=args.runs))


def _fleet_bench(args: argparse.Namespace) -> int:
    from extproc_lab.bench.fleet_state import run_fleet_bench

    return _run(run_fleet_bench(Path(args.out)))


def _big_bodies_bench(args: argparse.Namespace) -> int:
    import yaml

    from extproc_lab.bench.big_bodies import run_big_bodies_bench

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
    from extproc_lab.bench.scenarios import run_overhead

    conc = tuple(int(c) for c in args.concurrency.split(","))
    if args.workers:
        from extproc_lab.bench.workers_overhead import run_workers_overhead

        return _run(
            run_workers_overhead(
                workers=tuple(int(w) for w in args.workers.split(",")),
                requests=args.requests,
                concurrency=conc[-1],
                worker_ports=args.worker_ports,
                same_prompt=args.same_prompt,
                engines=args.engines,
                prompt_words=args.prompt_words,
                null_busy_us=args.null_busy_us,
                out_dir=Path(args.out if args.out != "out/overhead" else "out/overhead-workers"),
            )
        )
    modes = tuple(m.strip().upper() for m in args.modes.split(",") if m.strip())
    return _run(run_overhead(requests=args.requests, concurrency=conc, modes=modes, out_dir=Path(args.out)))


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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the lab's commands to `llm-extproc`'s parser."""
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
    p.description = DESCRIPTIONS["sim"]

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
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="with --workers: simulated engines, one cluster each (the demo runs 3)",
    )
    p.add_argument(
        "--prompt-words",
        type=int,
        default=800,
        help="with --workers: words in each user turn (~1 token each; 28000: a ~200 KB body)",
    )
    p.add_argument(
        "--null-busy-us",
        type=float,
        default=None,
        help="with --workers: also the do-nothing processor spending this many CPU microseconds a "
        "request (the in-process decision's cost: the floor of a processor that makes it)",
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
