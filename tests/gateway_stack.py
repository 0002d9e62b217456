"""Test harness: simulated engines on a background loop, plus the real service and real Envoy."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from extproc.gateway import (
    ENVOY_DIR,
    EnvoyProcess,
    ServiceProcess,
    ext_proc_filter,
    free_port,
    load_envoy_config,
    render_envoy_config,
)
from extproc.sim import SimEngine

MODEL = "sim-llama"


class Engines:
    """Simulated engines served from a private event loop on a daemon thread."""

    def __init__(self, count: int, token_delay_s: float = 0.005) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.engines = [SimEngine(f"engine-{i}", MODEL, token_delay_s) for i in range(count)]
        self.ports = [self._call(e.start("127.0.0.1", 0)) for e in self.engines]

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def by_name(self, name: str) -> SimEngine:
        return next(e for e in self.engines if e.name == name)

    def reset(self) -> None:
        for e in self.engines:
            e.stats.requests = e.stats.completed = e.stats.disconnected = e.stats.max_active = 0
            e.stats.routing_headers.clear()

    def close(self) -> None:
        for e in self.engines:
            self._call(e.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def service_config(**overrides: Any) -> dict[str, Any]:
    cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc.yaml").read_text())
    cfg.update(overrides)
    return cfg


class Stack:
    """The shipped envoy.yaml (addresses rewritten) + `llm-extproc serve` as real processes."""

    def __init__(
        self,
        engines: Engines,
        tmp: Path,
        *,
        envoy_file: str = "envoy.yaml",
        service: Mapping[str, Any] | None = None,
        clusters: Mapping[str, list[int]] | None = None,
        envoy_edit: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.engines = engines
        self.listener_port, self.admin_port = free_port(), free_port()
        self.service_port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.listener_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        if clusters is None:
            clusters = {"gpu-a": [0], "gpu-b": [1]}
        self.cluster_of = {engines.engines[i].name: c for c, idx in clusters.items() for i in idx}
        cfg = render_envoy_config(
            load_envoy_config(ENVOY_DIR / envoy_file),
            listener_port=self.listener_port,
            admin_port=self.admin_port,
            extproc=("127.0.0.1", self.service_port),
            clusters={c: [("127.0.0.1", engines.ports[i]) for i in idx] for c, idx in clusters.items()},
        )
        if envoy_edit is not None:
            envoy_edit(cfg)
        self.envoy_config = cfg
        self.service_config = copy.deepcopy(dict(service) if service is not None else service_config())
        self.service = ServiceProcess(
            self.service_config, self.service_port, tmp / "service.log", self.metrics_port
        )
        self.envoy = EnvoyProcess(cfg, self.admin_port, self.listener_port, tmp / "envoy.log")
        self.tmp = tmp

    def start(self) -> Stack:
        self.service.start()
        try:
            self.envoy.start()
            self.wait_extproc_healthy()
        except Exception:
            self.stop()
            raise
        return self

    def wait_extproc_healthy(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "llm-extproc::" in (text := self.envoy.admin("/clusters")) and any(
                line.startswith("llm-extproc::") and line.endswith("::health_flags::healthy")
                for line in text.splitlines()
            ):
                return
            time.sleep(0.1)
        raise TimeoutError("Envoy never saw llm-extproc healthy")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value} (labels as exposed)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def inflight(self) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith("llm_extproc_inflight_requests{"))

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text()[-4000:]}"
            for p in (self.tmp / "service.log", self.tmp / "envoy.log")
            if p.exists()
        )

    def stop(self) -> None:
        self.envoy.stop()
        self.service.stop()


def set_body_mode(mode: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        pm = ext_proc_filter(cfg)["processing_mode"]
        pm["request_body_mode"] = mode
        if mode == "FULL_DUPLEX_STREAMED":
            pm["request_trailer_mode"] = "SEND"  # required by Envoy for full duplex

    return edit


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
