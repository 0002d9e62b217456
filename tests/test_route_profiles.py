"""Per-route tuning in envoy.yaml: a route names a scheduling profile through ext_proc's
per-route gRPC initial metadata, and the service schedules that route's requests with it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gateway_stack import MODEL, Stack, service_config

from extproc_lab.engines import EngineGroup

pytestmark = pytest.mark.envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def sticky_route(cfg: dict[str, Any]) -> None:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(
        0,
        {
            "match": {"prefix": "/", "headers": [{"name": "x-tenant", "string_match": {"exact": "sticky"}}]},
            "route": {"cluster_header": "x-llm-destination-cluster", "timeout": "0s"},
            "typed_per_filter_config": {
                "envoy.filters.http.ext_proc": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                    "overrides": {"grpc_initial_metadata": [{"key": "x-llm-profile", "value": "sticky"}]},
                }
            },
        },
    )


@pytest.fixture(scope="module")
def stack(engines: EngineGroup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = service_config(
        scheduling={
            "profile": "default",
            "profiles": {
                "default": {"scorers": ["least-outstanding"]},
                "sticky": {"scorers": [{"name": "session-affinity", "weight": 1.0}]},
            },
        }
    )
    s = Stack(engines, tmp_path_factory.mktemp("profiles"), service=cfg, envoy_edit=sticky_route).start()
    yield s
    s.stop()


async def served_by(stack: Stack, n: int, **headers: str) -> Counter[str]:
    got: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(stack.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
                assert r.status == 200
                await r.read()
                got[r.headers["x-sim-engine"]] += 1
    return got


async def test_route_with_sticky_profile_keeps_sessions_on_one_engine(stack: Stack) -> None:
    homes = set()
    for i in range(6):
        got = await served_by(stack, 4, **{"x-tenant": "sticky", "x-session-id": f"session-{i}"})
        assert len(got) == 1, got  # every request of the session went to the same engine
        homes.update(got)
    assert len(homes) == 2  # and different sessions live on different engines


async def test_default_route_ignores_sessions(stack: Stack) -> None:
    got = await served_by(stack, 20, **{"x-session-id": "session-0"})
    assert len(got) == 2, got  # least-outstanding with random ties spreads one session's requests
