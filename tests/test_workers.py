"""`llm-extproc serve --workers N` behind real Envoy: requests succeed, every worker routes some, a
worker killed with SIGKILL is restarted by the supervisor, SIGTERM stops them all; a supervisor
whose workers keep dying gives up with a non-zero exit."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from gateway_stack import MODEL, service_config, wait_until

from extproc.server.workers import Supervisor, offset_port
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway, RedisProcess

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
ROUTED = "llm_extproc_requests_total{"


def test_offset_port() -> None:
    assert offset_port("0.0.0.0:9090", 2) == "0.0.0.0:9092"
    assert offset_port("[::1]:9002", 1) == "[::1]:9003"


def test_supervisor_gives_up_when_workers_keep_dying() -> None:
    dying = [sys.executable, "-c", "import sys; sys.exit(3)"]
    started = time.monotonic()
    assert Supervisor([dying, dying], max_restarts=3, window_s=60).run() == 1
    assert time.monotonic() - started < 30  # it stopped instead of restarting forever


def test_supervisor_forwards_sigterm_and_exits_zero(tmp_path: Path) -> None:
    marker = tmp_path / "got"
    # A worker that records SIGTERM and exits 0, as `serve` does after its phased shutdown.
    code = (
        "import signal, sys, time, pathlib\n"
        f"p = pathlib.Path({str(marker)!r} + sys.argv[1])\n"
        "signal.signal(signal.SIGTERM, lambda *a: (p.write_text('x'), sys.exit(0)))\n"
        "while True: time.sleep(0.05)\n"
    )
    sup = Supervisor([[sys.executable, "-c", code, "0"], [sys.executable, "-c", code, "1"]])

    def stop_soon() -> None:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_soon, daemon=True).start()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert sup.run() == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert (tmp_path / "got0").exists() and (tmp_path / "got1").exists()


@pytest.fixture(scope="module")
def engines() -> Iterator[EngineGroup]:
    group = EngineGroup([0.005, 0.005], MODEL, max_batch=8)
    yield group
    group.close()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _routed(gw: LocalGateway, worker: int) -> float:
    try:
        samples = gw.metrics(worker)
    except OSError:
        return -1.0
    return sum(v for k, v in samples.items() if k.startswith(ROUTED) and 'outcome="routed"' in k)


async def _load(url: str, n: int, concurrency: int = 8) -> Counter[int]:
    statuses: Counter[int] = Counter()
    todo = iter(range(n))

    async def client(s: aiohttp.ClientSession) -> None:
        for _ in todo:
            async with s.post(url + "/v1/chat/completions", json=CHAT) as r:
                await r.read()
                statuses[r.status] += 1

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
    return statuses


@pytest.mark.envoy
@pytest.mark.parametrize("ports", ["consecutive", pytest.param("shared", marks=pytest.mark.slow)])
async def test_two_workers_behind_envoy(engines: EngineGroup, tmp_path: Path, ports: str) -> None:
    engines.reset()
    redis = RedisProcess(tmp_path / "redis.log").start()  # the workers' shared state and relay
    gw = LocalGateway(
        tmp_path / "gw",
        clusters={"gpu-a": [engines.ports[0]], "gpu-b": [engines.ports[1]]},
        service=service_config(fleet={"url": redis.url, "pool": "workers"}),
        workers=2,
        worker_ports=ports,
    )
    try:
        gw.start()
        assert wait_until(lambda: _routed(gw, 1) >= 0, 20), gw.logs()
        statuses = await _load(gw.url, 200)
        assert statuses == Counter({200: 200}), gw.logs()
        per_worker = [_routed(gw, 0), _routed(gw, 1)]
        print(f"{ports}: routed per worker {per_worker}")
        assert sum(per_worker) == 200
        if ports == "consecutive":  # Envoy balances streams over the listed endpoints
            assert min(per_worker) > 0, per_worker
        assert gw.service.proc is not None
        supervisor = gw.service.proc.pid
        before = _children(supervisor)
        assert len(before) == 2
        os.kill(before[1], signal.SIGKILL)
        assert wait_until(lambda: len(set(_children(supervisor)) - set(before)) == 1, 10)
        assert wait_until(lambda: _routed(gw, 0) >= 0 and _routed(gw, 1) == 0, 20), gw.logs()
        gw.wait_extproc_healthy()
        statuses = await _load(gw.url, 100)
        assert statuses == Counter({200: 100}), gw.logs()
        assert "restarting it" in gw.service.log_path.read_text()
        workers = _children(supervisor)
        assert gw.service.terminate(skip_announce=True) == 0
        assert all(not Path(f"/proc/{pid}").exists() for pid in workers)
    finally:
        gw.stop()
        redis.stop()
