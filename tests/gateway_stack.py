"""Test harness: simulated engines on a background loop, plus the real service and real Envoy."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from extproc_lab.engines import EngineGroup
from extproc_lab.stack import ENVOY_DIR, LocalGateway

MODEL = "sim-llama"


def service_config(**overrides: Any) -> dict[str, Any]:
    """The shipped service config without its Redis fleet block (static pool + own in-flight counts),
    with overrides; fleet tests pass `fleet=` back in."""
    cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc.yaml").read_text())
    cfg.pop("fleet", None)
    cfg.update(overrides)
    return cfg


class Stack(LocalGateway):
    """LocalGateway over an EngineGroup, remembering which engine sits in which cluster."""

    def __init__(
        self,
        engines: EngineGroup,
        tmp: Path,
        *,
        envoy_file: str = "envoy.yaml",
        service: Mapping[str, Any] | None = None,
        clusters: Mapping[str, list[int]] | None = None,
        envoy_edit: Callable[[dict[str, Any]], None] | None = None,
        replicas: int = 1,
        bulk: bool = False,
    ) -> None:
        if clusters is None:
            clusters = {"gpu-a": [0], "gpu-b": [1]}
        self.engines = engines
        self.tmp = tmp
        self.cluster_of = {engines.engines[i].name: c for c, idx in clusters.items() for i in idx}
        super().__init__(
            tmp,
            clusters={c: [engines.ports[i] for i in idx] for c, idx in clusters.items()},
            service=copy.deepcopy(dict(service)) if service is not None else service_config(),
            envoy_file=envoy_file,
            envoy_edit=envoy_edit,
            replicas=replicas,
            bulk=bulk,
        )

    def inflight(self, *, bulk: bool = False) -> float:
        samples = self.metrics(bulk=bulk).items()
        return sum(v for k, v in samples if k.startswith("llm_extproc_inflight_requests{"))


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
