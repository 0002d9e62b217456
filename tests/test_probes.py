"""/healthz and /readyz on the metrics port mean something: the loop turns, and the service takes
new requests (not while shutting down); /metrics is still served there."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from gateway_stack import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import config_from_dict
from extproc.server import app
from extproc.server.completions import PendingReleases
from extproc.telemetry import Metrics, MetricsServer
from extproc_lab.stack import free_port

POOL = {"clusters": [{"name": "gpu-a", "models": ["m"]}]}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def test_probes_follow_the_service_phase() -> None:
    port = free_port()
    cfg = config_from_dict(
        {"pool": POOL, "listen": f"127.0.0.1:{free_port()}", "metrics_listen": f"127.0.0.1:{port}"}
    )
    running = await app.start(cfg)
    base = f"http://127.0.0.1:{port}"
    try:
        assert await asyncio.to_thread(get, base + "/healthz") == (200, "ok\n")
        assert await asyncio.to_thread(get, base + "/readyz") == (200, "ready\n")
        assert await asyncio.to_thread(get, base + "/serving") == (200, "serving\n")
        status, text = await asyncio.to_thread(get, base + "/metrics")
        assert status == 200 and "llm_extproc_requests_total" in text
        assert 'llm_extproc_build_info{grpcio="' in text
        await running.announce(0)  # SIGTERM's first phase: no longer ready, still alive
        assert await asyncio.to_thread(get, base + "/readyz") == (503, "not ready: announce\n")
        assert await asyncio.to_thread(get, base + "/serving") == (503, "not ready: announce\n")
        assert (await asyncio.to_thread(get, base + "/healthz"))[0] == 200
    finally:
        await running.drain(1)
        await running.close()


async def test_a_background_loop_that_keeps_failing_fails_readiness_and_grpc_health(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service's own sweeper loop raises every time: /readyz and gRPC health say not serving
    (the replica leaves the pool) while /healthz stays OK (no restart loop for a bad record)."""
    from extproc.telemetry import supervision

    monkeypatch.setattr(supervision, "BACKOFF_S", (0.01, 0.02))
    port = free_port()
    cfg = config_from_dict(
        {"pool": POOL, "listen": f"127.0.0.1:{free_port()}", "metrics_listen": f"127.0.0.1:{port}"}
    )

    async def broken(self: object) -> None:
        raise RuntimeError("sweep failed")

    monkeypatch.setattr(PendingReleases, "sweep_forever", broken)
    running = await app.start(cfg)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            if supervision.failing():
                break
            await asyncio.sleep(0.02)
        status, text = await asyncio.to_thread(get, base + "/readyz")
        assert status == 503 and "lease-sweeper" in text and "sweep failed" in text
        assert (await asyncio.to_thread(get, base + "/healthz"))[0] == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):  # gRPC health follows the probes every UPDATE_EVERY_S
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await running.drain(1)
        await running.close()


def test_a_stalled_event_loop_fails_liveness() -> None:
    probes = app._Probes()
    assert probes.live() == (True, "ok")
    probes.last_beat = time.monotonic() - 30  # no beat for 30 s: the loop is wedged
    ok, reason = probes.live()
    assert not ok and "stalled" in reason
    assert probes.ready()[0] is False


def test_a_failing_probe_is_a_503_not_a_traceback() -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    server = MetricsServer(Metrics(["m"], ["gpu-a"]), f"127.0.0.1:{free_port()}", {"/readyz": broken})
    try:
        status, text = get(f"http://127.0.0.1:{server.port}/readyz")
        assert status == 503 and text == "probe failed: RuntimeError\n"
        assert get(f"http://127.0.0.1:{server.port}/healthz")[0] == 200  # no probe there: metrics text
    finally:
        server.close()


def _half_request(port: int) -> socket.socket:
    """A slowloris client: connects, sends a request line and one header, never the blank line."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):  # whatever the server says before it hangs up (a 400), then the end
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        return True


def test_slow_clients_cannot_hold_the_metrics_port_or_its_threads() -> None:
    """Connections that send half a request neither block /metrics and the probes nor grow threads
    without bound: at most `max_connections` handler threads; a new connection evicts the oldest one
    still sending its head; one silent for the socket timeout, or trickling past the deadline, is
    dropped."""
    server = MetricsServer(
        Metrics(["m"], ["gpu-a"]),
        f"127.0.0.1:{free_port()}",
        {"/healthz": lambda: (True, "ok")},
        max_connections=4,
        socket_timeout_s=1.0,
        deadline_s=2.5,
    )
    port, http = server.port, server.server
    base = f"http://127.0.0.1:{port}"

    def handler_threads() -> int:  # this process's HTTP handler threads (other tests' threads vary)
        return sum("process_request_thread" in t.name for t in threading.enumerate())

    handlers_before = handler_threads()
    slow: list[socket.socket] = []
    try:
        slow = [_half_request(port) for _ in range(3)]  # under the bound: served alongside
        time.sleep(0.2)
        assert get(base + "/metrics")[0] == 200
        slow += [_half_request(port) for _ in range(40)]  # far over it
        time.sleep(0.3)
        assert handler_threads() <= handlers_before + 4 and http.open_connections() <= 4
        started = time.monotonic()
        assert get(base + "/healthz") == (200, "ok\n")  # evicts a half-sent request, at once
        assert time.monotonic() - started < 1.0
        status, text = get(base + "/metrics")
        assert status == 200 and "llm_extproc_requests_total" in text
        assert http.evicted >= 2
        # Every slow client is dropped within the socket timeout (plus the server's poll).
        assert all(_closed_by_server(s, 3.0) for s in slow)
        assert wait_until(lambda: http.open_connections() == 0, 2.0)
        assert wait_until(lambda: handler_threads() <= handlers_before, 2.0)
        # One that keeps the socket timeout at bay by trickling a byte at a time meets the deadline.
        trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.append(trickle)
        started = time.monotonic()
        closed = False
        for _ in range(40):
            try:
                trickle.sendall(b"X")
            except OSError:
                closed = True
                break
            trickle.settimeout(0.5)
            try:
                if trickle.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - started < 2.5 + 1.5
        assert http.expired >= 1 and get(base + "/healthz") == (200, "ok\n")
    finally:
        for s in slow:
            s.close()
        server.close()
