"""`publish --envoy-admin`: instances come from envoy.yaml, read through a real Envoy's admin API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from extproc.publishers import discover_from_envoy
from extproc_lab.stack import (
    ENVOY_DIR,
    EnvoyProcess,
    free_port,
    load_envoy_config,
    render_envoy_config,
)

pytestmark = pytest.mark.envoy


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyProcess]:
    cfg = render_envoy_config(
        load_envoy_config(ENVOY_DIR / "envoy.yaml"),
        listener_port=0,  # Envoy binds both itself
        admin_port=0,
        extproc=("127.0.0.1", free_port()),
        clusters={"gpu-a": [("127.0.0.1", 18001), ("127.0.0.1", 18011)], "gpu-b": [("127.0.0.1", 18002)]},
    )
    # A cluster without llm-extproc metadata is not an engine pool and must be ignored.
    cfg["static_resources"]["clusters"].append(
        {
            "name": "not-a-model-server",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": "not-a-model-server",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {"address": "127.0.0.1", "port_value": 18999}
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
    )
    proc = EnvoyProcess(cfg, 0, 0, Path(tmp_path_factory.mktemp("discovery")) / "envoy.log")
    proc.start()
    yield proc
    proc.stop()


async def test_tagged_clusters_and_their_hosts_are_discovered(envoy: EnvoyProcess) -> None:
    async with aiohttp.ClientSession() as s:
        found = await discover_from_envoy(s, f"http://127.0.0.1:{envoy.admin_port}")
    by_id = {i.upstream_id: i for i in found}
    assert set(by_id) == {"gpu-a/127.0.0.1:18001", "gpu-a/127.0.0.1:18011", "gpu-b/127.0.0.1:18002"}
    for inst in found:
        assert inst.engine == "vllm"
        assert inst.models == ("sim-llama",)
        assert inst.capacity_weight == 1.0
        assert not inst.draining
        assert inst.url(inst.metrics_path) == f"http://{inst.address}/metrics"


async def test_unreachable_admin_raises_a_client_error() -> None:
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            await discover_from_envoy(s, f"http://127.0.0.1:{free_port()}")
