"""/healthz and /readyz on the metrics port mean something: the loop turns, and the service takes
new requests (not while shutting down); /metrics is still served there."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

from extproc.config import config_from_dict
from extproc.lab.stack import free_port
from extproc.server import app
from extproc.telemetry import Metrics, MetricsServer

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
        status, text = await asyncio.to_thread(get, base + "/metrics")
        assert status == 200 and "llm_extproc_requests_total" in text
        assert 'llm_extproc_build_info{grpcio="' in text
        await running.announce(0)  # SIGTERM's first phase: no longer ready, still alive
        assert await asyncio.to_thread(get, base + "/readyz") == (503, "not ready: announce\n")
        assert (await asyncio.to_thread(get, base + "/healthz"))[0] == 200
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
