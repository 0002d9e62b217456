"""The LoRA target live: 10 adapters on 6 engines of 4 adapter slots, through real processes.

Per policy: six simulated engines serving LoRA adapters (fixed-cost: 1-3 s a request, at most 16 at
once; `server.LoraSlots`: at most 4 distinct adapters in the running batch, an LRU of 4 in GPU memory,
0.3 s to load one that is not there; they publish vLLM's `vllm:lora_requests_info`), real Envoy with
the shipped envoy.yaml, the service, Redis and the publisher. The pool and the publisher list the
adapters as models (docs/tuning.md, "Serving LoRA adapters"). Poisson arrivals, each request asking
for an adapter by name with popularity ~ 1/rank^zipf. Policies run one after the other on fresh
engines, with the same request stream:

- `lora`: the profile docs/tuning.md recommends (filter and scorer `lora-affinity` + least-outstanding);
- `least-outstanding`: load balancing alone, the contrast.

Measured after a warm-up, from the engines' own counters: the share of requests whose adapter was in
the engine's GPU memory when they arrived (target >= 90 %), each engine's share of the requests
against the fair share (target: none above 2x), adapter loads, errors.

    python -m extproc_lab.bench.lora_live --out out/lora-live
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from extproc.publishers import InstanceSpec
from extproc_lab.bench.lora_latency import LORA_PROFILE
from extproc_lab.bench.scenarios import MODEL, _n_cluster_gateway, start_publisher, wait_published
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import local_redis

POLICIES: dict[str, dict[str, Any]] = {
    "lora": LORA_PROFILE,
    "least-outstanding": {
        "scorers": ["least-outstanding"],
        "picker": {"name": "max-score", "params": {"seed": 1}},
    },
}
TOKEN_DELAY_S = 0.02  # per output token: 50-150 tokens are 1-3 s


@dataclass(slots=True)
class LoraLive:
    policy: str
    requests: int  # sent after the warm-up
    errors: int
    landed_loaded: float  # of the requests after the warm-up, adapter in GPU memory on arrival
    max_share_vs_fair: float  # the busiest engine's share of requests over 1 / engines
    adapter_loads: int
    per_engine: dict[str, int]


async def run_policy(
    policy: str,
    workdir: Path,
    *,
    engines: int = 6,
    adapters: int = 10,
    slots: int = 4,
    rate: float = 30.0,
    duration_s: float = 60.0,
    warmup_s: float = 10.0,
    zipf: float = 1.0,
    seed: int = 1,
    replicas: int = 1,
) -> LoraLive:
    """One policy's run; `replicas` service processes share the routing (with several, each sees the
    adapters loaded where from the same snapshots, and the others' picks through replica sync)."""
    names = [f"adapter-{k}" for k in range(adapters)]
    group = EngineGroup([TOKEN_DELAY_S] * engines, MODEL, max_batch=16, lora_slots=slots, lora_load_s=0.3)
    stops: list[Any] = [group.close]
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        redis, _ = local_redis(workdir / "redis.log")
        stops.append(redis.stop)
        clusters = {f"gpu-{i}": [p] for i, p in enumerate(group.ports)}
        models = [MODEL, *names]
        pool = {"clusters": [{"name": c, "models": models} for c in clusters]}
        gw = _n_cluster_gateway(
            workdir, clusters, redis.url, POLICIES[policy], replicas=replicas, service_extra={"pool": pool}
        )
        publisher = start_publisher(
            redis.url,
            [InstanceSpec(c, f"127.0.0.1:{p[0]}", "sim", models=tuple(models)) for c, p in clusters.items()],
            stops,
            interval_s=1.0,
            scrape_timeout_s=0.8,
        )
        gw.start()
        stops.append(gw.stop)
        await wait_published(publisher, engines)
        return await _drive(policy, gw.url, group, names, rate, duration_s, warmup_s, zipf, seed)
    finally:
        for stop in reversed(stops):
            res = stop()
            if asyncio.iscoroutine(res):
                await res


def _stats(group: EngineGroup) -> dict[str, dict[str, int]]:
    out = {}
    for e, port in zip(group.engines, group.ports, strict=True):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as r:
            out[e.name] = json.loads(r.read())
    return out


async def _drive(
    policy: str,
    url: str,
    group: EngineGroup,
    names: list[str],
    rate: float,
    duration_s: float,
    warmup_s: float,
    zipf: float,
    seed: int,
) -> LoraLive:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(len(names))]
    errors = 0
    served: Counter[str] = Counter()
    before: dict[str, dict[str, int]] = {}
    t0 = time.perf_counter()

    async def one(session: aiohttp.ClientSession, body: dict[str, Any], counted: bool) -> None:
        nonlocal errors
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                if counted:
                    if r.status != 200:
                        errors += 1
                    else:
                        served[r.headers.get("x-sim-engine", "?")] += 1
        except (TimeoutError, aiohttp.ClientError):
            if counted:
                errors += 1

    async def snapshot_after(delay: float) -> None:
        await asyncio.sleep(delay)
        before.update(await asyncio.to_thread(_stats, group))

    tasks = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        marker = asyncio.create_task(snapshot_after(warmup_s))
        at = rng.expovariate(rate)
        while at < duration_s:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "model": rng.choices(names, weights)[0],
                "messages": [{"role": "user", "content": "hello " * 20}],
                "max_tokens": rng.randint(50, 150),
            }
            tasks.append(asyncio.create_task(one(session, body, at >= warmup_s)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        await marker
    after = await asyncio.to_thread(_stats, group)
    hits = sum(after[n]["lora_hits"] - before[n]["lora_hits"] for n in after)
    misses = sum(after[n]["lora_misses"] - before[n]["lora_misses"] for n in after)
    loads = sum(after[n]["lora_loads"] - before[n]["lora_loads"] for n in after)
    total = sum(served.values())
    per_engine = {e.name: served.get(e.name, 0) for e in group.engines}
    fair = total / len(per_engine) if per_engine else 0.0
    return LoraLive(
        policy=policy,
        requests=total + errors,
        errors=errors,
        landed_loaded=hits / (hits + misses) if hits + misses else 0.0,
        max_share_vs_fair=max(per_engine.values()) / fair if fair else 0.0,
        adapter_loads=loads,
        per_engine=per_engine,
    )


def markdown(results: list[LoraLive], meta: dict[str, Any]) -> str:
    lines = [
        f"LoRA live ({meta['engines']} engines x {meta['slots']} adapter slots, {meta['adapters']} adapters, "
        f"{meta.get('replicas', 1)} service replica(s), "
        f"zipf {meta['zipf']}, {meta['rate']} req/s for {meta['duration_s']} s, warm-up "
        f"{meta['warmup_s']} s excluded)",
        "",
        "| policy | requests | errors | landed where loaded | busiest engine / fair share | adapter loads |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.requests} | {r.errors} | {r.landed_loaded:.1%} | {r.max_share_vs_fair:.2f}x "
            f"| {r.adapter_loads} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extproc_lab.bench.lora_live", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--engines", type=int, default=6)
    ap.add_argument("--adapters", type=int, default=10)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1, help="service processes behind Envoy")
    ap.add_argument("--out", type=Path, default=Path("out/lora-live"))
    args = ap.parse_args(argv)
    results = []
    for policy in [p for p in args.policies.split(",") if p]:
        if policy not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        r = asyncio.run(
            run_policy(
                policy,
                args.out / policy,
                engines=args.engines,
                adapters=args.adapters,
                slots=args.slots,
                rate=args.rate,
                duration_s=args.duration,
                warmup_s=args.warmup,
                zipf=args.zipf,
                seed=args.seed,
                replicas=args.replicas,
            )
        )
        print(
            f"{policy}: landed where loaded {r.landed_loaded:.1%}, busiest {r.max_share_vs_fair:.2f}x fair, "
            f"{r.errors} errors of {r.requests}",
            flush=True,
        )
        results.append(r)
    meta = {k: getattr(args, k) for k in ("engines", "adapters", "slots", "rate", "zipf", "seed", "replicas")}
    meta |= {"duration_s": args.duration, "warmup_s": args.warmup}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_live.json").write_text(
        json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2)
    )
    table = markdown(results, meta)
    (args.out / "lora_live.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
