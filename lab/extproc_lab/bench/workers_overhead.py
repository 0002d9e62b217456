"""`llm-extproc bench-overhead --workers 1,2,3`: requests/s through Envoy + `serve --workers N` against
Envoy routing directly, closed loop, one fast engine, ~1k-token chat prompts (a shared system
prompt and a different user turn per request, so the tokenizer's cache helps only where it would
in production), with the production setup: Redis and a publisher feeding snapshots.

CPU per routed request is read from /proc (user + system time of the service's processes, and of
Envoy's) over the timed run, so it is a figure per request, independent of how busy the machine is.
Configurations run one after another; the direct baseline runs first and last (their mean is the
reference), which bounds drift from other load on the machine. A do-nothing Python processor
(extproc_lab.bench.null_processor: the same message exchange, no routing work) runs in the service's
place too: the floor any Python processor sets on this machine, which the service's throughput and
CPU are judged against; with `null_busy_us`, once more spending that much CPU a request (the floor of
a processor whose only work is a decision of that cost).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from extproc.fleet.redis_feed import RedisSettings
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
from extproc_lab.bench.loadgen import one_request
from extproc_lab.bench.report import RequestRecord, summarize
from extproc_lab.bench.scenarios import MODEL, Baselines, _service_config, n_clusters
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway, ServiceProcess, find_envoy, local_redis, wait_port

TICK = os.sysconf("SC_CLK_TCK")
_TEXT = (
    "the model server routes requests across a fleet of accelerators while the gateway keeps "
    "connections warm and the scheduler weighs cache locality queue depth and memory pressure "
    "before it picks an instance for every prompt that arrives from many tenants at once"
)
WORDS = tuple(_TEXT.split(" "))


def chat_bodies(n: int, seed: int = 0, same: bool = False, words: int = 800) -> list[dict[str, Any]]:
    """`n` chat requests of ~1k tokens: one ~200-token system prompt, a user turn of `words` words
    (~1 token each) each (`same`: one body n times, which the tokenizer's per-message cache then
    serves)."""
    if same:
        return chat_bodies(1, seed, words=words) * n
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(200))
    return [
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words))},
            ],
        }
        for i in range(n)
    ]


class NullProcess(ServiceProcess):
    """The do-nothing processor on a service's port (so Envoy's llm-extproc cluster reaches it)."""

    cluster = "gpu-a"
    busy_us = 0.0

    def start(self, timeout: float = 20.0) -> None:
        log = self.log_path.open("ab")
        command = [sys.executable, "-m", "extproc_lab.bench.null_processor", "--port", str(self.port)]
        command += ["--cluster", self.cluster, "--busy-us", str(self.busy_us)]
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_port("127.0.0.1", self.port, timeout)
        except TimeoutError:
            self.stop()
            raise


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes (and their reaped children), from /proc."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / TICK


def _tree(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    return [pid, *(int(c) for c in children)]


async def _closed_loop(
    url: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    todo = iter(bodies)

    async def worker(session: aiohttp.ClientSession) -> None:
        for body in todo:
            records.append(await one_request(session, url, body))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        started = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return records, time.perf_counter() - started


async def run_workers_overhead(
    *,
    workers: tuple[int, ...] = (1, 2, 3),
    requests: int = 2000,
    concurrency: int = 8,
    worker_ports: str = "consecutive",
    same_prompt: bool = False,
    engines: int = 1,
    prompt_words: int = 800,
    null_busy_us: float | None = None,
    out_dir: Path = Path("out/overhead-workers"),
) -> int:
    find_envoy()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    group = EngineGroup([0.0] * engines, MODEL)
    clusters = {f"gpu-{chr(ord('a') + i)}": [port] for i, port in enumerate(group.ports)}
    redis, notice = local_redis(out_dir / "redis.log")
    if notice != "redis-server":
        print(notice)
    publisher = Publisher(
        PublisherConfig(
            redis=RedisSettings(url=redis.url, pool="demo"),
            instances=[InstanceSpec(c, f"127.0.0.1:{ports[0]}", "sim") for c, ports in clusters.items()],
            interval_s=0.5,
        )
    )
    stop = asyncio.Event()
    pub_task = asyncio.create_task(publisher.run(stop))
    bodies = chat_bodies(requests + 100, same=same_prompt, words=prompt_words)
    warm, timed = bodies[:100], bodies[100:]
    rows: list[dict[str, Any]] = []

    async def measure(name: str, url: str, pids: list[int], envoy_pid: int, n_workers: int) -> None:
        path = url + "/v1/chat/completions"
        await _closed_loop(path, warm, concurrency)
        cpu0, env0 = cpu_seconds(pids), cpu_seconds([envoy_pid])
        records, wall = await _closed_loop(path, timed, concurrency)
        cpu1, env1 = cpu_seconds(pids), cpu_seconds([envoy_pid])
        s = summarize(name, records, wall)
        ok = max(1, len(records) - s.errors)
        row = {
            "target": name,
            "workers": n_workers,
            "concurrency": concurrency,
            "rps": s.throughput_rps,
            "p50_ms": s.e2e_p50_ms,
            "p99_ms": s.e2e_p99_ms,
            "errors": s.errors,
            "service_cpu_ms_per_request": 1000 * (cpu1 - cpu0) / ok if pids else 0.0,
            "envoy_cpu_ms_per_request": 1000 * (env1 - env0) / ok,
        }
        rows.append(row)
        print(
            f"{name:28s} {s.throughput_rps:7.0f} req/s  p50 {s.e2e_p50_ms:6.2f} ms  p99 "
            f"{s.e2e_p99_ms:6.2f} ms  errors {s.errors}  service CPU "
            f"{row['service_cpu_ms_per_request']:.2f} ms/req  "
            f"envoy CPU {row['envoy_cpu_ms_per_request']:.2f} ms/req",
            flush=True,
        )

    async def baseline(tag: str) -> None:
        (out_dir / f"direct-{tag}").mkdir()
        base = Baselines(out_dir / f"direct-{tag}", group.ports, ["ROUND_ROBIN"])
        try:
            target = base.start()[0]
            envoy = base.procs[0][1].proc
            assert envoy is not None
            await measure(f"envoy direct ({tag})", target.url, [], envoy.pid, 0)
        finally:
            base.stop()

    try:
        await asyncio.sleep(1.0)  # the first snapshot
        await baseline("first")
        service_cfg = _service_config(clusters, redis.url)
        shipped, envoy_edit = n_clusters(clusters)
        for busy in (0.0, *([null_busy_us] if null_busy_us else [])):
            name = "do-nothing Python processor" + (f" + {busy:g} us busy" if busy else "")
            null_gw = LocalGateway(
                out_dir / f"null-{busy:g}", clusters=shipped, service=service_cfg, envoy_edit=envoy_edit
            )
            service = null_gw.service
            processor = NullProcess({}, service.port, service.log_path)
            processor.busy_us = busy
            processor.cluster = ",".join(clusters)  # each engine in turn, as the service spreads them
            null_gw.services = [processor]
            null_gw.service = processor
            try:
                await asyncio.to_thread(null_gw.start)
                assert processor.proc is not None and null_gw.envoy.proc is not None
                await measure(
                    name, null_gw.url, [processor.proc.pid], null_gw.envoy.proc.pid, -2 if busy else -1
                )
            finally:
                await asyncio.to_thread(null_gw.stop)
        for n in workers:
            gw = LocalGateway(
                out_dir / f"workers-{n}",
                clusters=shipped,
                envoy_edit=envoy_edit,
                service=_service_config(clusters, redis.url),
                workers=n,
                worker_ports=worker_ports,
            )
            try:
                await asyncio.to_thread(gw.start)
                assert gw.service.proc is not None and gw.envoy.proc is not None
                pids = _tree(gw.service.proc.pid)
                await measure(f"llm-extproc --workers {n}", gw.url, pids, gw.envoy.proc.pid, n)
            finally:
                await asyncio.to_thread(gw.stop)
        await baseline("last")
    finally:
        stop.set()
        await pub_task
        redis.stop()
        group.close()
    direct = [r["rps"] for r in rows if r["workers"] == 0]
    reference = sum(direct) / len(direct)
    null = next(r for r in rows if r["workers"] == -1)
    print(f"\nenvoy direct: {reference:.0f} req/s (mean of {', '.join(f'{d:.0f}' for d in direct)})")
    for r in rows:
        if r["workers"]:
            r["ratio_to_direct"] = r["rps"] / reference
            r["ratio_to_null"] = r["rps"] / null["rps"]
            r["cpu_ms_over_null"] = r["service_cpu_ms_per_request"] - null["service_cpu_ms_per_request"]
            print(
                f"{r['target']}: {r['ratio_to_direct']:.2f}x of Envoy direct, {r['ratio_to_null']:.2f}x of "
                f"the do-nothing processor, CPU {r['cpu_ms_over_null']:+.2f} ms/req over it"
            )
    path = out_dir / "results.json"
    meta = {
        "scenario": "closed loop, chat prompts, engines answering at once",
        "engines": engines,
        "user_turn_words": prompt_words,
        "body_bytes_median": sorted(len(json.dumps(b)) for b in timed)[len(timed) // 2],
        "cpus": os.cpu_count(),
        "worker_ports": worker_ports,
        "prompts": "one repeated" if same_prompt else "a different user turn each",
    }
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"results: {path}")
    return 0
