"""Restarts and replica failure: phased shutdown in process, then real Envoy in front of two real
`llm-extproc serve` replicas (both in the llm-extproc cluster) and simulated engines, under load.

The load is short requests, streaming and not, from several concurrent clients: whatever the
ext_proc filter does after routing (keep the stream until the response ends, or end it at once),
these tests only count what clients see.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from gateway_stack import MODEL, service_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import config_from_dict
from extproc.server import start
from extproc.server.app import EXT_PROC_SERVICE
from extproc.settings import (
    DEFAULT_SHUTDOWN_ANNOUNCE_S,
    ENVOY_EXTPROC_HC_INTERVAL_S,
    ENVOY_EXTPROC_HC_TIMEOUT_S,
    ENVOY_EXTPROC_HC_UNHEALTHY_THRESHOLD,
    ConfigError,
)
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import ENVOY_DIR, ext_proc_filter, load_envoy_config
from extproc_lab.stack.processes import LocalGateway

POOL = {"clusters": [{"name": "gpu-a", "models": ["m"]}, {"name": "gpu-b", "models": ["m"]}]}
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WORKERS = 6  # concurrent clients: at most this many requests are in flight at any instant
# For the comparison in docs/operations.md: a comma list of measures to switch off (`announce`:
# shutdown_announce_s 0, the old behaviour; `retry`: the ext_proc retry_policy; `outlier`: outlier
# detection on llm-extproc). The process tests then fail, and their messages give the counts.
WITHOUT = {w.strip() for w in os.environ.get("LLM_EXTPROC_TEST_WITHOUT", "").split(",") if w.strip()}


# -- settings -------------------------------------------------------------------------------------
def _seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


@pytest.mark.parametrize("envoy_file", ["envoy.yaml", "endpoint-picker.yaml"])
def test_announce_default_follows_the_shipped_health_check(envoy_file: str) -> None:
    cfg = load_envoy_config(ENVOY_DIR / envoy_file)
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "llm-extproc")
    hc = cluster["health_checks"][0]
    assert _seconds(hc["interval"]) == ENVOY_EXTPROC_HC_INTERVAL_S
    assert _seconds(hc["timeout"]) == ENVOY_EXTPROC_HC_TIMEOUT_S
    assert hc["unhealthy_threshold"] == ENVOY_EXTPROC_HC_UNHEALTHY_THRESHOLD
    worst_detection = hc["unhealthy_threshold"] * _seconds(hc["interval"]) + _seconds(hc["timeout"])
    assert worst_detection < DEFAULT_SHUTDOWN_ANNOUNCE_S
    # What makes a dead replica cost only the streams it had answered (docs/operations.md):
    retry = ext_proc_filter(cfg)["grpc_service"]["retry_policy"]  # GrpcService's; envoy_grpc's is ignored
    assert "connect-failure" in retry["retry_on"] and "refused-stream" in retry["retry_on"]
    assert cluster["circuit_breakers"]["thresholds"][0]["max_retries"] >= 10_000
    assert cluster["outlier_detection"]["split_external_local_origin_errors"] is True


def test_announce_setting_is_validated() -> None:
    assert config_from_dict({"pool": POOL}).shutdown_announce_s == DEFAULT_SHUTDOWN_ANNOUNCE_S == 6.0
    assert config_from_dict({"pool": POOL, "shutdown_announce_s": 0}).shutdown_announce_s == 0.0
    for bad in (-1, "6s", True, 3600):
        with pytest.raises(ConfigError, match="shutdown_announce_s"):
            config_from_dict({"pool": POOL, "shutdown_announce_s": bad})


@pytest.mark.integration
def test_check_config_rejects_a_bad_announce(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("shutdown_announce_s: -2\npool: {clusters: [{name: a, models: [m]}]}\n")
    out = subprocess.run(
        [sys.executable, "-m", "extproc.cli", "check-config", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "shutdown_announce_s" in out.stderr


# -- the phases, in process -----------------------------------------------------------------------
def _headers() -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    hmap = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap))
    msg.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    return msg


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_shutdown_announces_then_drains_then_cancels() -> None:
    running = await start(config_from_dict({"pool": POOL, "listen": "127.0.0.1:0", "metrics_listen": None}))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        ext = pb_grpc.ExternalProcessorStub(channel)
        held = ext.Process()  # a request mid-routing: headers answered, body never sent
        await held.write(_headers())
        assert (await held.read()).HasField("request_headers")

        second_signal = asyncio.Event()
        started = time.monotonic()
        stopping = asyncio.create_task(running.stop(0.5, announce=30.0, skip_announce=second_signal))
        await _until(lambda: running.phase == "announce")
        for name in ("", EXT_PROC_SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == NOT_SERVING
        fresh = ext.Process()  # announce: NOT_SERVING, yet a new stream is still served
        await fresh.write(_headers())
        assert (await fresh.read()).HasField("request_headers")
        fresh.cancel()

        second_signal.set()  # skips the rest of the 30 s announce period
        await _until(lambda: running.phase != "announce")
        draining = time.monotonic()
        late = ext.Process()  # drain: new streams are refused
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await late.write(_headers())
            await late.read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        await asyncio.wait_for(stopping, 10)  # the held stream is cancelled after the 0.5 s grace
        assert time.monotonic() - draining >= 0.4  # (the phase is polled every 10 ms)
        assert time.monotonic() - started < 10  # not the 30 s announce period
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await held.read()
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE  # grpc's "Cancelling all calls"
    assert running.phase == "stopped"


async def test_drain_does_not_wait_for_streams_that_are_not_requests() -> None:
    """Long-lived non-ext_proc streams (Envoy's gRPC access log, a health Watch) would hold the whole
    grace period: the drain ends once no ext_proc stream is open."""
    running = await start(config_from_dict({"pool": POOL, "listen": "127.0.0.1:0", "metrics_listen": None}))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        await watch.read()
        started = time.monotonic()
        await asyncio.wait_for(running.stop(30.0), 10)
        assert time.monotonic() - started < 10
        watch.cancel()


# -- real processes -------------------------------------------------------------------------------
@dataclass(slots=True)
class Outcome:
    started: float
    ok: bool
    detail: str


@dataclass
class Load:
    """WORKERS clients sending short requests back to back, alternating streaming and not."""

    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _worker(self, worker: int) -> None:
        n = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            while not self._stop.is_set():
                n += 1
                stream = (worker + n) % 2 == 0
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"client {worker} request {n}"}],
                    "max_tokens": 4,
                    "stream": stream,
                }
                started = time.monotonic()
                self.in_flight += 1
                try:
                    async with session.post(self.url + "/v1/chat/completions", json=body) as r:
                        data = await r.read()
                        ok = r.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
                        detail = f"{r.status} {data[:160]!r}"
                except (TimeoutError, aiohttp.ClientError) as exc:
                    ok, detail = False, repr(exc)[:200]
                finally:
                    self.in_flight -= 1
                self.outcomes.append(Outcome(started, ok, detail))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        tasks = [asyncio.create_task(self._worker(i)) for i in range(WORKERS)]
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)

    async def more(self, count: int, timeout: float = 15.0) -> None:
        """Wait until `count` more requests have completed (the load is really flowing)."""
        target = len(self.outcomes) + count
        await _until(lambda: len(self.outcomes) >= target, timeout)

    def errors(self, since: float = 0.0) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok and o.started >= since]


def _without(cfg: dict[str, Any]) -> None:
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "llm-extproc")
    if "retry" in WITHOUT:
        ext_proc_filter(cfg)["grpc_service"].pop("retry_policy", None)
    if "outlier" in WITHOUT:
        cluster.pop("outlier_detection", None)


@pytest.fixture
def gateway(engines: EngineGroup, tmp_path: Path) -> Iterator[LocalGateway]:
    engines.reset()
    for e in engines.engines:
        e.token_delay_s = 0.005
    service = service_config(**({"shutdown_announce_s": 0} if "announce" in WITHOUT else {}))
    gw = LocalGateway(
        tmp_path,
        clusters={"gpu-a": [engines.ports[0]], "gpu-b": [engines.ports[1]]},
        service=service,
        replicas=2,
        envoy_edit=_without,
    ).start()
    yield gw
    gw.stop()


def _routed(metrics_port: int) -> float:
    """Requests a replica has routed since it started (0 while its /metrics is not up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
    except OSError:
        return 0.0
    return sum(
        float(ln.rpartition(" ")[2])
        for ln in lines
        if ln.startswith("llm_extproc_requests_total{") and 'outcome="routed"' in ln
    )


async def _wait_healthy(gw: LocalGateway, **kw: Any) -> None:
    await asyncio.to_thread(gw.wait_extproc_healthy, 15.0, **kw)


async def test_rolling_restart_of_two_replicas_under_load_loses_nothing(gateway: LocalGateway) -> None:
    load = Load(gateway.url)
    async with load.running():
        await load.more(20)
        for i, replica in enumerate(gateway.services):
            before = len(load.outcomes)
            assert await asyncio.to_thread(replica.terminate, 30.0) == 0  # announce, drain, exit 0
            assert len(load.outcomes) > before  # traffic kept flowing through the other replica
            replica.start()
            await _wait_healthy(gateway)  # both replicas back before the next one goes
            await _until(lambda i=i: _routed(gateway.metrics_ports[i]) > 0, 10)  # and routing again
        await load.more(20)
    errors = load.errors()
    print(f"\nrolling restart of 2 replicas: {len(load.outcomes)} requests, {len(errors)} errors")
    assert errors == [], f"{len(errors)} of {len(load.outcomes)} failed: {errors[:5]}\n{gateway.logs()}"
    log = gateway.services[0].log_path.read_text()
    assert "shutdown 1/3 announce" in log and "shutdown 2/3 drain" in log


async def test_killed_replica_costs_only_requests_in_flight_at_that_instant(gateway: LocalGateway) -> None:
    load = Load(gateway.url)
    victim = gateway.services[1]
    async with load.running():
        await load.more(20)
        in_flight_at_kill = load.in_flight
        killed_at = time.monotonic()
        victim.kill()  # SIGKILL, and wait until it is gone
        await load.more(60)  # Envoy routes around it...
        await _wait_healthy(gateway, ports=[victim.port], healthy=False)  # ...and has set it aside
        after_kill = len(load.outcomes)
        victim.start()
        await _wait_healthy(gateway)
        await _until(lambda: _routed(victim.metrics_port or 0) > 0, 10)  # it is back in rotation
        await load.more(20)
    errors = load.errors()
    print(
        f"\nkill -9 of 1 of 2 replicas: {len(load.outcomes)} requests, {in_flight_at_kill} in flight at "
        f"the kill, {len(errors)} errors, {len(load.errors(since=killed_at))} of them sent after it"
    )
    detail = f"{len(errors)} errors: {errors[:5]}\n{gateway.logs()}"
    # Measured on 2 shared cores: 0-2 errors per kill with 6 clients (~600 without the ext_proc
    # retry_policy and the outlier detection in envoy.yaml). The bound is structural, not a timing:
    # only a request that was already in flight when the process died may fail...
    assert len(errors) <= in_flight_at_kill <= WORKERS, detail
    assert all(e.started < killed_at for e in errors), detail
    # ...and every request sent after it, while it was down and after it came back, succeeded.
    assert len(load.outcomes) - after_kill >= 20
    assert load.errors(since=killed_at) == [], detail
