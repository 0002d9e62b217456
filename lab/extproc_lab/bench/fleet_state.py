"""`llm-extproc bench-fleet`: how many snapshots per second the service ingests, and how long a routing
decision takes with 10, 100 and 1000 instances in the fleet view."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from extproc.config import config_from_dict
from extproc.fleet import FleetView
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.redis_feed import RedisFeed, RedisSettings
from extproc.lifecycle import RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.telemetry import Metrics
from extproc_lab.stack import RedisProcess

MODEL = "bench-model"
CLUSTERS = 10


def _config(n: int, mode: str, redis_url: str | None = None) -> dict[str, Any]:
    clusters = []
    for c in range(CLUSTERS):
        eps = (
            [f"10.0.{c}.{i // 250}:{8000 + i % 250}" for i in range(c, n, CLUSTERS)]
            if mode == "endpoint"
            else []
        )
        clusters.append({"name": f"pool-{c}", "models": [MODEL], **({"endpoints": eps} if eps else {})})
    raw: dict[str, Any] = {"pool": {"clusters": clusters}, "routing": mode, "metrics_listen": None}
    if redis_url:
        raw["fleet"] = {"url": redis_url}
    return raw


def _snapshots(n: int, seq: int, rng: random.Random) -> list[bytes]:
    now_ms = int(time.time() * 1000)
    out = []
    for i in range(n):
        c = i % CLUSTERS
        addr = f"10.0.{c}.{i // CLUSTERS // 250}:{8000 + (i // CLUSTERS) % 250}"
        out.append(
            spb.UpstreamSnapshot(
                upstream_id=f"pool-{c}/{addr}",
                cluster=f"pool-{c}",
                address=addr,
                engine="vllm",
                models=[MODEL],
                readiness=spb.READY,
                num_running=rng.randint(0, 32),
                num_waiting=rng.randint(0, 20),
                kv_cache_usage=rng.random() * 0.95,
                kv_blocks_total=4096,
                kv_blocks_free=1024,
                block_size=16,
                publisher_id="bench",
                sequence=seq,
                published_at_ms=now_ms,
                ttl_ms=60_000,
            ).SerializeToString()
        )
    return out


def _head() -> Any:
    return parse_head(
        {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
        session_header="x-session-id",
        user_header="x-user-id",
        priority_header="x-llm-priority",
    )


def decision_latency(
    n: int,
    mode: str,
    decisions: int = 3000,
    *,
    explain: dict[str, Any] | None = None,
    asked: bool = False,
    held_share: float = 0.0,
    prompt_words: int = 200,
) -> dict[str, float | str]:
    """Median and p99 of RequestLifecycle.route() (parse + schedule + record) with n fresh instances;
    `explain` is the service's `explain:` section, `asked` a request that wants the decision header.
    `held_share` > 0: the model has a tokenizer, and that share of the instances hold the prompt by
    their engines' KV events (a KvIndex), as a tenant's prompt on a tenth of a large pool.
    `prompt_words`: the prompt's length (~1 token a word)."""
    rng = random.Random(n)
    raw = _config(n, mode)
    if explain is not None:
        raw["explain"] = explain
    folder = Path(tempfile.mkdtemp(prefix="bench-fleet-")) if held_share else None
    if folder is not None:
        from extproc_lab.bench.tokenization import train_tokenizer

        raw["tokenizers"] = {MODEL: train_tokenizer(folder, vocab_size=2000)}
    cfg = config_from_dict(raw, base_dir=folder)
    metrics = Metrics([MODEL], [f"pool-{c}" for c in range(CLUSTERS)])
    view = FleetView(cfg.pool)
    known = view.known_clusters
    from extproc.fleet import decode

    for data in _snapshots(n, 1, rng):
        view.apply(decode(data, known))
    view.rebuild()
    lifecycle = RequestLifecycle(cfg, metrics, view)
    head = _head()
    content = "hello " * prompt_words
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
    holders = 0
    if held_share:
        from extproc.fleet.kv_index import KvIndex, encode_full
        from extproc.tokenization import block_hashes

        ids = lifecycle.prepare(head, body).prompt_token_ids  # parsed and tokenized, not routed
        if not ids:
            raise RuntimeError("the bench's tokenizer gave no token ids")
        hashes = block_hashes(ids, 64)
        index = KvIndex(stale_after_s=3600.0)
        for u in view.candidates(MODEL) or ():
            if rng.random() < held_share:
                index.apply_full(encode_full(u.id, 1, 1, hashes))
                holders += 1
        lifecycle.state.kv = index
    times = []
    for _ in range(decisions):
        t0 = time.perf_counter()
        if asked:  # as the stream does: explain, then format the header
            d = lifecycle.route(head, body, explain=True)
            assert d.explanation is not None
            d.explanation.header_value()
        else:
            d = lifecycle.route(head, body)
        times.append(time.perf_counter() - t0)
        lifecycle.finish(d, "response_end")
    times.sort()
    return {
        "instances": n,
        "mode": mode,
        "candidates": len(view.candidates(MODEL) or ()),
        "p50_us": statistics.median(times) * 1e6,
        "p99_us": times[int(len(times) * 0.99)] * 1e6,
        "kv_holders": holders,
    }


def ingest_rate(n: int = 1000, rounds: int = 20) -> dict[str, float]:
    """Snapshots/s through decode + validate + apply (no Redis), and the rebuild cost at n instances."""
    rng = random.Random(0)
    cfg = config_from_dict(_config(n, "endpoint"))
    metrics = Metrics([MODEL], [f"pool-{c}" for c in range(CLUSTERS)])
    view = FleetView(cfg.pool)
    feed = RedisFeed(RedisSettings(), view, metrics)
    batches = [_snapshots(n, r + 1, rng) for r in range(rounds)]
    t0 = time.perf_counter()
    for batch in batches:
        for data in batch:
            feed.ingest(data)
    ingest_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        view.rebuild()
    rebuild_s = (time.perf_counter() - t0) / 20
    return {"snapshots_per_s": n * rounds / ingest_s, "rebuild_ms_at_n": rebuild_s * 1000, "n": n}


async def redis_rate(total: int = 20_000, instances: int = 1000) -> dict[str, float]:
    """End to end through a real redis-server: pipelined SET+PUBLISH by a publisher client, followed by
    the service's feed, both in this process (so the figure is a floor on 2 shared cores)."""
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisProcess(Path(tmp) / "redis.log").start()
        try:
            cfg = config_from_dict(_config(instances, "endpoint", server.url))
            assert cfg.fleet is not None
            metrics = Metrics([MODEL], [f"pool-{c}" for c in range(CLUSTERS)])
            view = FleetView(cfg.pool)
            feed = RedisFeed(cfg.fleet, view, metrics)
            feed.start()
            await feed.connected.wait()
            client = aioredis.from_url(server.url)
            rng = random.Random(1)
            rounds = total // instances

            def accepted() -> float:
                labels = {"outcome": "accepted", "reason": ""}
                return metrics.registry.get_sample_value("llm_extproc_snapshots_total", labels) or 0.0

            t0 = time.perf_counter()
            for r in range(rounds):
                async with client.pipeline(transaction=False) as pipe:
                    for data in _snapshots(instances, r + 1, rng):
                        pipe.publish(cfg.fleet.channel, data)
                    await pipe.execute()
            while accepted() < rounds * instances and time.perf_counter() - t0 < 120:
                await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - t0
            got = accepted()
            await feed.stop()
            await client.aclose()
            return {"published": rounds * instances, "applied": got, "snapshots_per_s": got / elapsed}
        finally:
            server.stop()


async def run_fleet_bench(out_dir: Path = Path("out/fleet")) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"decision": [], "ingest": None, "redis": None}
    print("decision latency (RequestLifecycle.route: parse + filters + scorers + pick + record)")
    for mode in ("endpoint", "cluster"):
        for n in (10, 100, 1000):
            r = decision_latency(n, mode)
            report["decision"].append(r)
            print(
                f"  {mode:8s} {n:5d} instances ({r['candidates']:4d} candidates): "
                f"p50 {r['p50_us']:7.1f} us  p99 {r['p99_us']:7.1f} us"
            )
    # Token ids and the engines' KV events, a ~4k-token prompt held by a tenth of a 1000-endpoint pool:
    # the pre-selection ranks ~100 holders by their match length before predicting 64 candidates.
    r = decision_latency(1000, "endpoint", held_share=0.1, prompt_words=4000)
    report["decision_kv_events"] = r
    print(
        f"  endpoint  1000 instances, {r['kv_holders']} holding a ~4k-token prompt by KV events (token ids): "
        f"p50 {r['p50_us']:7.1f} us  p99 {r['p99_us']:7.1f} us"
    )
    ing = ingest_rate()
    report["ingest"] = ing
    print(
        f"ingestion without Redis (decode + validate + apply): {ing['snapshots_per_s']:,.0f} snapshots/s; "
        f"view rebuild at {ing['n']} instances: {ing['rebuild_ms_at_n']:.2f} ms"
    )
    try:
        red = await redis_rate()
        report["redis"] = red
        print(
            f"through redis-server pub/sub: {red['snapshots_per_s']:,.0f} snapshots/s "
            f"({red['applied']:.0f}/{red['published']} applied)"
        )
        out = await outage_latency(out_dir=out_dir)
        report["outage"] = out
        print(
            f"request latency through Envoy, Redis up: p50 {out['up_p50_ms']:.2f} ms "
            f"p99 {out['up_p99_ms']:.2f} ms; "
            f"Redis stopped: p50 {out['down_p50_ms']:.2f} ms p99 {out['down_p99_ms']:.2f} ms "
            f"({out['down_errors']} errors)"
        )
    except FileNotFoundError as exc:
        print(f"(skipped the Redis measurements: {exc})")
    path = out_dir / "results.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"results: {path}")
    return 0


async def outage_latency(requests: int = 600, out_dir: Path = Path("out/fleet")) -> dict[str, float]:
    """Request latency through real Envoy + service with Redis up, then right after Redis is stopped
    (snapshots still fresh): the request path must not notice the outage."""
    from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
    from extproc_lab.bench.loadgen import closed_loop
    from extproc_lab.bench.report import summarize
    from extproc_lab.engines import EngineGroup
    from extproc_lab.stack import LocalGateway

    out_dir.mkdir(parents=True, exist_ok=True)
    group = EngineGroup([0.0, 0.0], "sim-llama")
    redis = RedisProcess(out_dir / "outage-redis.log").start()
    clusters = {"gpu-a": [group.ports[0]], "gpu-b": [group.ports[1]]}
    service = {
        "pool": {"clusters": [{"name": c, "models": ["sim-llama"]} for c in clusters]},
        "fleet": {"url": redis.url},
    }
    gw = LocalGateway(out_dir / "outage", clusters=clusters, service=service)
    publisher = Publisher(
        PublisherConfig(
            redis=RedisSettings(url=redis.url),
            instances=[InstanceSpec(c, f"127.0.0.1:{p[0]}", "sim") for c, p in clusters.items()],
            interval_s=0.5,
            ttl_s=60.0,  # long enough that the snapshots stay fresh through the measurement
        )
    )
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    body = {"model": "sim-llama", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 500}]}
    try:
        gw.start()
        url = gw.url + "/v1/chat/completions"  # Envoy picks its port at start
        await asyncio.sleep(1.5)
        await closed_loop(url, body, 50, 1)
        up = summarize("redis up", *(await closed_loop(url, body, requests, 1)))
        if up.errors:  # the gateway itself is broken: the comparison would mean nothing
            raise RuntimeError(f"{up.errors} of {requests} requests failed with Redis up (logs: {out_dir})")
        stop.set()
        await task
        redis.stop()
        await asyncio.sleep(0.5)
        down = summarize("redis down", *(await closed_loop(url, body, requests, 1)))
    finally:
        stop.set()
        gw.stop()
        redis.stop()
        group.close()
    return {
        "up_p50_ms": up.e2e_p50_ms or 0.0,
        "up_p99_ms": up.e2e_p99_ms or 0.0,
        "down_p50_ms": down.e2e_p50_ms or 0.0,
        "down_p99_ms": down.e2e_p99_ms or 0.0,
        "down_errors": down.errors,
    }
