"""The big-body route: requests that declare >= 1 MiB are processed by a second service process
(`serve --role bulk`, Envoy's llm-extproc-bulk cluster), so their parsing never runs in the process
that routes small requests; with the bulk process down, the main one takes them (priority 1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import requests
from gateway_stack import MODEL, Stack, service_config, wait_until

from extproc.server.app import replica_id
from extproc_lab.engines import EngineGroup

pytestmark = pytest.mark.envoy


def routed(stack: Stack, *, bulk: bool) -> float:
    samples = stack.metrics(bulk=bulk).items()
    return sum(
        v for k, v in samples if k.startswith("llm_extproc_requests_total{") and 'outcome="routed"' in k
    )


def chat(size: int) -> bytes:
    content = "The parties agree as follows. " * (size // 30)
    return orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]})


@pytest.fixture
def stack(engines: EngineGroup, tmp_path: Path) -> Iterator[Stack]:
    engines.reset()
    s = Stack(engines, tmp_path / "stack", service=service_config(), bulk=True).start()
    yield s
    s.stop()


def test_replica_ids_of_the_bulk_process_are_told_apart_by_prefix() -> None:
    assert replica_id("bulk").startswith("bulk")
    # Hex ids can never start with "bulk" ('u', 'l', 'k' are not hex digits): the access-log filter
    # in envoy.yaml cannot send a main replica's entries to the bulk process.
    assert all(not replica_id("main").startswith("bulk") for _ in range(100))
    with pytest.raises(ValueError, match="unknown role"):
        replica_id("other")


def test_big_bodies_go_to_the_bulk_process_small_ones_stay(stack: Stack) -> None:
    url = stack.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    for _ in range(3):
        assert requests.post(url, data=chat(2_000_000), headers=headers, timeout=30).status_code == 200
        assert requests.post(url, data=chat(300), headers=headers, timeout=30).status_code == 200
    assert routed(stack, bulk=True) == 3, stack.logs()
    assert routed(stack, bulk=False) == 3, stack.logs()
    # Each process hears about the ends of its own requests (the second access logger for "bulk"
    # tickets), so both in-flight counts return to zero without Redis.
    assert wait_until(lambda: stack.inflight(bulk=True) == 0 and stack.inflight() == 0), stack.logs()

    # A chunked big body declares no length: the main process handles it (documented limit).
    def chunks() -> Iterator[bytes]:
        body = chat(2_000_000)
        for i in range(0, len(body), 256 * 1024):
            yield body[i : i + 256 * 1024]

    assert requests.post(url, data=chunks(), headers=headers, timeout=30).status_code == 200
    assert routed(stack, bulk=False) == 4


@pytest.mark.parametrize("wait_for_health_check", [False, True], ids=["at-once", "after-check"])
def test_bulk_process_down_the_main_one_takes_big_bodies(stack: Stack, wait_for_health_check: bool) -> None:
    url = stack.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    assert stack.bulk_service is not None
    stack.bulk_service.kill()
    if wait_for_health_check:
        stack.wait_bulk_healthy(healthy=False)
    # At once: the first connect failure ejects the bulk host and the retry reaches the main one.
    statuses = [
        requests.post(url, data=chat(2_000_000), headers=headers, timeout=30).status_code for _ in range(3)
    ]
    assert statuses == [200] * 3, stack.logs()
    assert routed(stack, bulk=False) == 3
    assert wait_until(lambda: stack.inflight() == 0), stack.logs()


def test_shipped_bulk_cluster_matches_the_compose_processes() -> None:
    """envoy.yaml's llm-extproc-bulk cluster: the bulk process first, the main process as failover,
    on the ports the compose stack's two `serve` processes listen on."""
    import yaml

    from extproc_lab.stack import ENVOY_DIR
    from extproc_lab.stack.processes import BULK_CLUSTER, EXT_PROC_CLUSTER, load_envoy_config

    clusters = {
        c["name"]: c for c in load_envoy_config(ENVOY_DIR / "envoy.yaml")["static_resources"]["clusters"]
    }

    def ports(cluster: str) -> list[tuple[int, int]]:
        levels = clusters[cluster]["load_assignment"]["endpoints"]
        return [
            (level.get("priority", 0), e["endpoint"]["address"]["socket_address"]["port_value"])
            for level in levels
            for e in level["lb_endpoints"]
        ]

    (main_port,) = [p for _, p in ports(EXT_PROC_CLUSTER)]
    compose_file = Path(__file__).resolve().parent.parent / "compose" / "docker-compose.yml"
    compose = yaml.safe_load(compose_file.read_text())["services"]

    def listen(service: str) -> int:
        cmd = compose[service]["command"]
        return int(cmd[cmd.index("--listen") + 1].rpartition(":")[2])

    assert ports(BULK_CLUSTER) == [(0, listen("llm-extproc-bulk")), (1, main_port)]
    assert listen("llm-extproc") == main_port
    assert "--role" in compose["llm-extproc-bulk"]["command"]
