"""Side-by-side runs on loopback: the demo (routing quality) and ext_proc overhead.

Each run starts real Envoy processes (one config with llm-extproc, baselines without it) in front of
the same simulated engines, drives the same requests through each, and writes JSON results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.fleet.redis_feed import RedisSettings
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
from extproc.settings import DEFAULT_PUBLISH_INTERVAL_S
from extproc_lab.bench.loadgen import closed_loop, open_loop
from extproc_lab.bench.report import Report, RequestRecord, Slo, format_table, plot, summarize, write_json
from extproc_lab.bench.workloads import make_workload
from extproc_lab.engines import EngineGroup
from extproc_lab.engines.profiles import GpuProfile
from extproc_lab.stack import (
    ENVOY_DIR,
    EnvoyProcess,
    LocalGateway,
    baseline_envoy_config,
    body_mode_edit,
    find_envoy,
    free_port,
    load_envoy_config,
    local_redis,
)

MODEL = "sim-llama"


@dataclass(slots=True)
class Target:
    name: str
    url: str


def _service_config(
    clusters: dict[str, list[int]], redis_url: str | None = None, profile: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The default scheduling profile (or `profile`); with `redis_url`, live fleet state from the
    publisher."""
    cfg: dict[str, Any] = {
        "routing": "cluster",
        "pool": {"clusters": [{"name": c, "models": [MODEL]} for c in clusters]},
    }
    if profile is not None:
        cfg["scheduling"] = {"profile": "bench", "profiles": {"bench": profile}}
    if redis_url:
        cfg["fleet"] = {"url": redis_url, "pool": "demo"}
    return cfg


class Baselines:
    """Envoy without ext_proc over the same engines, one process per load-balancing policy."""

    def __init__(self, workdir: Path, ports: list[int], policies: list[str]) -> None:
        self.procs: list[tuple[str, EnvoyProcess]] = []
        template = load_envoy_config(ENVOY_DIR / "envoy.yaml")
        for policy in policies:
            cfg = baseline_envoy_config(
                template,
                listener_port=0,  # Envoy binds both ports itself; read back after start()
                admin_port=0,
                endpoints=[("127.0.0.1", p) for p in ports],
                lb_policy=policy,
            )
            self.procs.append((policy, EnvoyProcess(cfg, 0, 0, workdir / f"envoy-{policy.lower()}.log")))

    def start(self) -> list[Target]:
        targets = []
        for policy, proc in self.procs:
            proc.start()
            targets.append(Target(f"envoy {policy.lower()}", f"http://127.0.0.1:{proc.listener_port}"))
        return targets

    def stop(self) -> None:
        for _, proc in self.procs:
            proc.stop()


async def run_demo(
    *,
    requests: int = 150,
    rate: float = 3.5,
    tenants: int = 64,
    out_dir: Path = Path("out/demo"),
) -> int:
    """The README's main job: three simulated A10G engines (engine model: batching, KV cache with prefix
    reuse) serving a multi-tenant workload whose system prompts exceed the fleet's KV cache, routed by
    llm-extproc (Envoy + service + Redis + publisher) and by Envoy alone, side by side."""
    find_envoy()  # fail early with the install hint
    policies = ["llm-extproc", "envoy-round-robin", "envoy-least-request"]
    if _sglang_router() is not None:
        policies.append("sglang-cache-aware")
    profiles = ["a10g-llama3-8b"] * 3
    print(
        f"demo: {len(profiles)} simulated A10G engines (Llama-3-8B profile, docs/simulator.md), workload "
        f"shared-prefix: {tenants} tenants x 2000-token system prompts ({tenants * 2000:,} tokens of "
        f"prefixes vs {len(profiles) * 34_160:,} tokens of KV cache in the fleet), {requests} streaming "
        f"requests at {rate:g} req/s, open loop. Policies: {', '.join(policies)}. Each gets a fresh fleet."
    )
    reports = await run_live_bench(
        workload="shared-prefix",
        policies=policies,
        profiles=profiles,
        rate=rate,
        count=requests,
        params={"tenants": tenants},
        out_dir=out_dir,
    )
    by_name = {r.name: r for r in reports}
    ours, rr = by_name.get("llm-extproc"), by_name.get("envoy-round-robin")
    if ours and rr and ours.ttft_p90_ms and rr.ttft_p90_ms:
        print(
            f"\nllm-extproc vs Envoy round robin: TTFT p90 {ours.ttft_p90_ms:.0f} ms "
            f"vs {rr.ttft_p90_ms:.0f} ms, "
            f"goodput {ours.goodput_rps:.2f} vs {rr.goodput_rps:.2f} req/s, prefix-cache hit rate "
            f"{_pct(ours.prefix_cache_hit_rate)} vs {_pct(rr.prefix_cache_hit_rate)}"
        )
    print(f"plots: {out_dir}/live-shared-prefix-ttft-cdf.png, {out_dir}/live-shared-prefix-in-flight.png")
    return 0 if all(r.errors == 0 for r in reports) else 1


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


EnvoyEdit = Callable[[dict[str, Any]], None]


def n_clusters(clusters: dict[str, list[int]]) -> tuple[dict[str, list[int]], EnvoyEdit]:
    """envoy.yaml ships two GPU clusters (gpu-a, gpu-b); more are added by copying gpu-b's definition
    and shipped ones not in `clusters` are dropped (so is the fallback route's list, accordingly).
    Returns the shipped clusters to give LocalGateway and its `envoy_edit` for the rest."""

    def add_cluster(cfg: dict[str, Any]) -> None:
        cl = cfg["static_resources"]["clusters"]
        names = {c["name"] for c in cl}
        for name, ports in clusters.items():
            if name in names:
                continue
            extra = json.loads(json.dumps(next(c for c in cl if c["name"] == "gpu-b")))
            extra["name"] = name
            extra["load_assignment"] = {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}
                                }
                            }
                            for p in ports
                        ]
                    }
                ],
            }
            cl.append(extra)

    def edit(cfg: dict[str, Any]) -> None:
        add_cluster(cfg)
        cl = cfg["static_resources"]["clusters"]
        cfg["static_resources"]["clusters"] = [
            c for c in cl if c["name"] in clusters or c["name"] == "llm-extproc"
        ]
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
            if "weighted_clusters" in route["route"]:  # the fail-open fallback route
                route["route"]["weighted_clusters"]["clusters"] = [{"name": c, "weight": 1} for c in clusters]

    return {k: v for k, v in clusters.items() if k in ("gpu-a", "gpu-b")}, edit


def _n_cluster_gateway(
    out_dir: Path,
    clusters: dict[str, list[int]],
    redis_url: str | None,
    profile: dict[str, Any] | None = None,
    replicas: int = 1,
    service_extra: dict[str, Any] | None = None,
) -> LocalGateway:
    """A gateway over any number of GPU clusters (n_clusters)."""
    shipped, edit = n_clusters(clusters)
    service = {**_service_config(clusters, redis_url, profile), **(service_extra or {})}
    return LocalGateway(out_dir, clusters=shipped, service=service, envoy_edit=edit, replicas=replicas)


async def run_overhead(
    *,
    requests: int = 400,
    concurrency: tuple[int, ...] = (1, 8),
    modes: tuple[str, ...] = ("BUFFERED", "FULL_DUPLEX_STREAMED"),
    out_dir: Path = Path("out/overhead"),
) -> int:
    """Latency and throughput through Envoy with and without llm-extproc (one gateway per body mode),
    engines answering at once, so the difference is the gateway's own cost."""
    find_envoy()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    group = EngineGroup([0.0, 0.0], MODEL)
    clusters = {"gpu-a": [group.ports[0]], "gpu-b": [group.ports[1]]}
    gateways = [
        (
            mode,
            LocalGateway(
                out_dir / mode.lower(),
                clusters=clusters,
                service=_service_config(clusters),
                envoy_edit=body_mode_edit(mode),
            ),
        )
        for mode in modes
    ]
    baselines = Baselines(out_dir, group.ports, ["ROUND_ROBIN"])
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 3000}]}
    rows: list[dict[str, Any]] = []
    try:
        targets = baselines.start()
        for mode, gw in gateways:
            gw.start()
            targets.append(Target(f"llm-extproc {mode.lower()}", gw.url))
        for c in concurrency:
            for t in targets:
                await closed_loop(t.url + "/v1/chat/completions", body, 50, c)  # warm-up
                results, wall = await closed_loop(t.url + "/v1/chat/completions", body, requests, c)
                s = summarize(f"{t.name} (c={c})", results, wall)
                rows.append({"target": t.name, "concurrency": c, **s.as_dict()})
                print(
                    f"{t.name:34s} c={c:<3d} p50 {s.e2e_p50_ms:.2f} ms  p99 {s.e2e_p99_ms:.2f} ms  "
                    f"{s.throughput_rps:.0f} req/s  errors {s.errors}",
                    flush=True,
                )
    finally:
        baselines.stop()
        for _, gw in gateways:
            gw.stop()
        group.close()
    print()
    for c in concurrency:
        base = next(r for r in rows if r["concurrency"] == c and r["target"].startswith("envoy"))
        for r in rows:
            if r["concurrency"] == c and r is not base:
                print(
                    f"c={c} {r['target']}: added p50 latency {r['e2e_p50_ms'] - base['e2e_p50_ms']:+.2f} ms, "
                    f"throughput ratio {r['throughput_rps'] / base['throughput_rps']:.2f}"
                )
    path = out_dir / "results.json"
    path.write_text(json.dumps({"scenario": "ext_proc overhead, 3 KB buffered body", "rows": rows}, indent=2))
    print(f"results: {path}")
    return 0


async def run_bench(
    *,
    workload: str,
    targets: list[Target],
    rate: float,
    count: int,
    seed: int = 0,
    model: str = MODEL,
    slo: Slo | None = None,
    warmup: int = 10,
    out_dir: Path = Path("out/bench"),
    params: dict[str, Any] | None = None,
) -> list[Report]:
    """`llm-extproc bench`: the same named workload, open loop, against each target in turn."""
    wl = make_workload(workload, rate=rate, count=count + warmup, seed=seed, model=model, **(params or {}))
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    warm, timed = requests[:warmup], requests[warmup:]
    start = timed[0][0] if timed else 0.0
    timed = [(a - start, b, t) for a, b, t in timed]
    out_dir.mkdir(parents=True, exist_ok=True)
    reports: list[Report] = []
    records_by_policy: dict[str, list[RequestRecord]] = {}
    for t in targets:
        url = t.url.rstrip("/") + "/v1/chat/completions"
        if warm:
            await open_loop(url, warm)
        records, wall = await open_loop(url, timed, progress=f"{t.name} ({workload})")
        reports.append(summarize(t.name, records, wall, slo))
        records_by_policy[t.name] = records
    print(format_table(reports))
    meta = {"workload": wl.name, "params": wl.params, "targets": {t.name: t.url for t in targets}}
    write_json(out_dir / f"{workload}.json", reports, meta)
    try:
        paths = plot(out_dir / workload, records_by_policy, slo=slo)
        print("plots: " + ", ".join(str(p) for p in paths))
    except ImportError as exc:
        print(f"(no plots: {exc})")
    print(f"results: {out_dir / f'{workload}.json'}")
    return reports


LIVE_POLICIES = (
    "llm-extproc",
    "envoy-round-robin",
    "envoy-least-request",
    "sglang-cache-aware",
    "vllm-router-cache-aware",
)


def _sglang_router() -> list[str] | None:
    """The command that runs sglang-router (an optional peer), if it is installed in this Python or in
    the interpreter named by $LLM_EXTPROC_SGLANG_PYTHON."""
    import importlib.util
    import os
    import sys

    python = os.environ.get("LLM_EXTPROC_SGLANG_PYTHON")
    if python:
        return [python, "-m", "sglang_router.launch_router"]
    if importlib.util.find_spec("sglang_router") is not None:
        return [sys.executable, "-m", "sglang_router.launch_router"]
    return None


def _vllm_router() -> list[str] | None:
    """The command that runs vllm-router (an optional peer, `pip install vllm-router`):
    $LLM_EXTPROC_VLLM_ROUTER, else the `vllm-router` script next to this Python, else its launcher
    module if importable."""
    import importlib.util
    import os
    import shutil
    import sys

    command = os.environ.get("LLM_EXTPROC_VLLM_ROUTER")
    if command:
        return [command]
    script = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if script:
        return [script]
    if importlib.util.find_spec("vllm_router") is not None:
        return [sys.executable, "-m", "vllm_router.launch_router"]
    return None


PEER_ROUTERS = {
    "sglang-cache-aware": ("sglang-router", _sglang_router),
    "vllm-router-cache-aware": ("vllm-router", _vllm_router),
}


def peer_missing(policy: str) -> str | None:
    """Why a live policy cannot run here (an optional peer that is not installed), or None."""
    if policy not in PEER_ROUTERS:
        return None
    package, find = PEER_ROUTERS[policy]
    return None if find() is not None else f"{package} not installed (pip install {package})"


async def run_live_bench(
    *,
    workload: str,
    policies: list[str],
    profiles: list[str],
    rate: float,
    count: int,
    seed: int = 0,
    slo: Slo | None = None,
    warmup: int = 10,
    time_scale: float = 1.0,
    params: dict[str, Any] | None = None,
    out_dir: Path = Path("out/bench"),
) -> list[Report]:
    """Each policy on a fresh fleet of model-driven simulated engines (cold KV caches), same requests."""
    import subprocess

    from extproc_lab.engines.profiles import PROFILES
    from extproc_lab.stack import wait_port

    find_envoy()
    unknown = [p for p in policies if p not in LIVE_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(LIVE_POLICIES)}")
    _quiet_http2_probes()  # sglang-router's HTTP/2 probes of the engines (the demo runs it too)
    gpu = [PROFILES[p] for p in profiles]
    out_dir.mkdir(parents=True, exist_ok=True)
    wl = make_workload(workload, rate=rate, count=count + warmup, seed=seed, model=MODEL, **(params or {}))
    requests = [(r.arrival_s, r.body, r.tag) for r in wl.requests]
    reports: list[Report] = []
    by_policy: dict[str, list[RequestRecord]] = {}
    for policy in policies:
        group = EngineGroup([], MODEL, profiles=gpu, time_scale=time_scale)
        names = [e.name for e in group.engines]
        stops: list[Any] = []
        try:
            url = await _start_target(policy, group, out_dir / policy, stops, subprocess, wait_port)
            if url is None:
                print(f"  {policy}: skipped ({peer_missing(policy)})")
                continue
            records, wall = await open_loop(
                url + "/v1/chat/completions", requests, progress=f"{policy} ({workload})"
            )
        finally:
            await _stop_target(stops, group)
        timed = [r for r in records[warmup:]]
        reports.append(summarize(policy, timed, wall, slo, instances=names))
        by_policy[policy] = timed
    print(format_table(reports))
    meta = {
        "workload": wl.name,
        "params": wl.params,
        "profiles": profiles,
        "time_scale": time_scale,
        "warmup": warmup,
        "note": "each policy ran on a fresh fleet (cold caches); warm-up requests excluded from the report",
    }
    path = write_json(out_dir / f"live-{workload}.json", reports, meta)
    try:
        plot(out_dir / f"live-{workload}", by_policy, slo=slo)
    except ImportError as exc:
        print(f"(no plots: {exc})")
    print(f"results: {path}")
    return reports


async def _start_target(
    policy: str,
    group: EngineGroup,
    workdir: Path,
    stops: list[Any],
    subprocess: Any,
    wait_port: Any,
    replicas: int = 1,
    service_extra: dict[str, Any] | None = None,
    gateways: list[LocalGateway] | None = None,
    max_num_seqs: bool = False,
) -> str | None:
    workdir.mkdir(parents=True, exist_ok=True)
    ports = group.ports
    if policy == "llm-extproc":
        redis, _ = local_redis(workdir / "redis.log")
        stops.append(redis.stop)
        clusters = {f"gpu-{i}": [p] for i, p in enumerate(ports)}
        gw = _n_cluster_gateway(workdir, clusters, redis.url, replicas=replicas, service_extra=service_extra)
        publisher = start_publisher(
            redis.url,
            # The engines' GPU names, as DCGM's modelName or the `gpu:` setting would give them.
            [
                InstanceSpec(
                    c,
                    f"127.0.0.1:{p[0]}",
                    "sim",
                    gpu=_gpu_name(group, i),
                    max_num_seqs=_max_num_seqs(group, i) if max_num_seqs else None,
                )
                for i, (c, p) in enumerate(clusters.items())
            ],
            stops,
        )
        gw.start()
        stops.append(gw.stop)
        if gateways is not None:
            gateways.append(gw)
        await wait_published(publisher, len(clusters))
        return gw.url
    if policy.startswith("envoy-"):
        lb = {"envoy-round-robin": "ROUND_ROBIN", "envoy-least-request": "LEAST_REQUEST"}[policy]
        base = Baselines(workdir, ports, [lb])
        stops.append(base.stop)
        return base.start()[0].url
    package, find = PEER_ROUTERS[policy]
    command = find()
    if command is None:
        return None
    port, metrics_port = free_port(), free_port()
    log = (workdir / f"{package}.log").open("ab")
    proc = subprocess.Popen(
        [
            *command,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics_port),
            "--policy",
            "cache_aware",
            "--worker-urls",
            *[f"http://127.0.0.1:{p}" for p in ports],
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stops.append(lambda: (proc.terminate(), proc.wait(10)))
    wait_port("127.0.0.1", port, 30)
    await asyncio.sleep(3.0)  # workers registered and health-checked
    return f"http://127.0.0.1:{port}"


def start_publisher(
    redis_url: str,
    instances: list[InstanceSpec],
    stops: list[Any],
    *,
    interval_s: float = DEFAULT_PUBLISH_INTERVAL_S,
    scrape_timeout_s: float | None = None,
) -> Publisher:
    """`llm-extproc publish` in this process's event loop for a lab stack (pool "demo"); how to stop
    it is appended to `stops` (an async callable)."""
    publisher = Publisher(
        PublisherConfig(
            redis=RedisSettings(url=redis_url, pool="demo"),
            instances=instances,
            interval_s=interval_s,
            scrape_timeout_s=scrape_timeout_s,
        )
    )
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))

    async def stop_publisher() -> None:
        stop.set()
        await task

    stops.append(stop_publisher)
    return publisher


async def wait_published(publisher: Publisher, count: int, timeout_s: float = 30.0) -> None:
    """Until `count` instances were published READY (a fixed sleep was too short on a loaded
    machine: requests sent before got 503s), then one more second for the service's feed."""
    deadline = time.monotonic() + timeout_s
    while publisher.ready_instances() < count and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)


def _gpu_name(group: EngineGroup, i: int) -> str:
    driver = group.engines[i].driver
    return driver.model.profile.gpu if driver is not None else ""


def _max_num_seqs(group: EngineGroup, i: int) -> int | None:
    """The engine's --max-num-seqs, as a publisher configured with it would publish."""
    driver = group.engines[i].driver
    return driver.model.profile.max_num_seqs if driver is not None else None


async def _stop_target(stops: list[Any], group: EngineGroup) -> None:
    """Undo `_start_target`: its `stops` last first (awaiting the async ones), then the engines."""
    for stop in reversed(stops):
        res = stop()
        if asyncio.iscoroutine(res):
            await res
    group.close()


async def run_live_requests(
    policy: str,
    requests: list[tuple[float, dict[str, Any], str]],
    profiles: list[GpuProfile],
    *,
    time_scale: float,
    workdir: Path,
    replicas: int = 1,
    service_extra: dict[str, Any] | None = None,
    agreement: list[tuple[float, int, str, float]] | None = None,
    headers: Sequence[dict[str, str] | None] | None = None,
    scheduling_policy: str = "fcfs",
    token_scales: Sequence[float] = (1.0,),
    max_num_seqs: bool = False,
    service_metrics: dict[str, float] | None = None,
) -> tuple[list[RequestRecord], float] | None:
    """One policy on a fresh fleet of `profiles` (cold caches) serving `requests` given in *virtual*
    time: arrivals are sent `time_scale` times faster and the records' latencies are converted back to
    virtual seconds (so they compare with the discrete-event mode; a router's own real overhead is
    magnified by `time_scale` in the process). Returns (records, virtual duration), or None when the
    policy's peer is not installed. With `agreement` (a list) and several llm-extproc replicas, each
    replica's `llm_extproc_sync_agreement{plugin}` is read every `AGREEMENT_EVERY_S` while the
    requests run and appended as (seconds since the first request, replica, plugin, value).
    `headers`: per request, sent with it (a priority class, an objective); `scheduling_policy`: the
    engines' (vLLM's `--scheduling-policy`); `token_scales`: each engine's tokens per built-in token
    (engines that count differently from a router's estimate; cycled); `max_num_seqs`: the publisher
    is configured with each engine's batch limit (llm-extproc only); `service_metrics` (a dict): filled
    with the first llm-extproc replica's samples once the last request has ended (real seconds)."""
    import subprocess

    from extproc_lab.stack import wait_port

    if policy not in LIVE_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(LIVE_POLICIES)}")
    if peer_missing(policy):
        return None
    _quiet_http2_probes()
    group = EngineGroup(
        [],
        MODEL,
        profiles=profiles,
        time_scale=time_scale,
        scheduling_policy=scheduling_policy,
        token_scales=token_scales,
    )
    stops: list[Any] = []
    gateways: list[LocalGateway] = []
    sampler: asyncio.Task[None] | None = None
    try:
        url = await _start_target(
            policy,
            group,
            workdir,
            stops,
            subprocess,
            wait_port,
            replicas,
            service_extra,
            gateways,
            max_num_seqs=max_num_seqs,
        )
        if url is None:
            return None
        if agreement is not None and gateways and replicas > 1:
            sampler = asyncio.create_task(_sample_agreement(gateways[0], replicas, agreement))
        real = [(a / time_scale, body, tag) for a, body, tag in requests]
        records, wall = await open_loop(url + "/v1/chat/completions", real, progress=policy, headers=headers)
        if service_metrics is not None and gateways:
            await asyncio.sleep(0.5)  # the access log's last entries (flushed every 20 ms)
            service_metrics.update(await asyncio.to_thread(gateways[0].metrics, 0))
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        await _stop_target(stops, group)
    for r in records:
        r.arrival_s *= time_scale
        r.e2e_s *= time_scale
        if r.ttft_s is not None:
            r.ttft_s *= time_scale
        r.inter_token_s = [g * time_scale for g in r.inter_token_s]
    return records, wall * time_scale


AGREEMENT_EVERY_S = 2.0
_AGREEMENT = 'llm_extproc_sync_agreement{plugin="'


async def _sample_agreement(
    gw: LocalGateway, replicas: int, out: list[tuple[float, int, str, float]]
) -> None:
    """Every replica's agreement gauges (server/sync.py), read from its metrics port until cancelled;
    a replica that does not answer is skipped for that round."""
    start = time.monotonic()
    while True:
        await asyncio.sleep(AGREEMENT_EVERY_S)
        for i in range(replicas):
            try:
                samples = await asyncio.to_thread(gw.metrics, i)
            except OSError:
                continue
            for key, value in samples.items():
                if key.startswith(_AGREEMENT):
                    plugin = key[len(_AGREEMENT) :].split('"', 1)[0]
                    out.append((time.monotonic() - start, i, plugin, value))


class _Http2ProbeFilter(logging.Filter):
    """sglang-router opens an HTTP/2 (gRPC) connection to each worker to detect its kind; the simulated
    engines speak HTTP/1.1 and aiohttp logs a traceback per probe. Those lines are dropped, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI" in str(exc))


def _quiet_http2_probes() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _Http2ProbeFilter) for f in logger.filters):
        logger.addFilter(_Http2ProbeFilter())
