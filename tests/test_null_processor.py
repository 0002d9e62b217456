"""The overhead bench's do-nothing processor (extproc_lab.bench.null_processor), in the service's place
behind real Envoy: the shipped envoy.yaml's exchange (headers, then the buffered body) is answered and
every request reaches the cluster it names (each in turn), so the bench's floor is a working processor."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from extproc_lab.bench.scenarios import MODEL, _service_config
from extproc_lab.bench.workers_overhead import NullProcess
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway


@pytest.mark.envoy
def test_the_do_nothing_processor_routes_each_request_to_its_clusters_in_turn(tmp_path: Path) -> None:
    group = EngineGroup([0.0, 0.0], MODEL)
    clusters = {"gpu-a": [group.ports[0]], "gpu-b": [group.ports[1]]}
    gw = LocalGateway(tmp_path, clusters=clusters, service=_service_config(clusters))
    null = NullProcess({}, gw.service.port, gw.service.log_path)
    null.cluster = "gpu-a,gpu-b"  # taken in turn
    null.busy_us = 50.0  # the bench's stand-in for a decision's CPU
    gw.services = [null]
    gw.service = gw.services[0]
    try:
        gw.start()
        body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        for _ in range(4):
            req = urllib.request.Request(
                gw.url + "/v1/chat/completions", body.encode(), {"content-type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
                assert json.loads(resp.read())["choices"]
        assert [e.stats.requests for e in group.engines] == [2, 2], gw.logs()
        # and each request's access-log entry went to it, as the service's do
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "grpc_access_log.logs_written: 4" not in gw.envoy.admin(
            "/stats"
        ):
            time.sleep(0.05)
        stats = [x for x in gw.envoy.admin("/stats").splitlines() if "grpc_access_log" in x]
        assert any(x.endswith("logs_written: 4") for x in stats), stats
    finally:
        gw.stop()
        group.close()


def test_the_workers_bench_sizes_its_bodies_and_fleet_as_asked() -> None:
    """`bench-overhead --workers N --prompt-words W --engines E`: ~W-token user turns (28000: the
    ~200 KB body the decision-cost target names) on E clusters (the demo's 3: gpu-c copied from
    gpu-b's definition)."""
    from extproc_lab.bench.scenarios import n_clusters
    from extproc_lab.bench.workers_overhead import chat_bodies

    small, big = chat_bodies(2)[1], chat_bodies(2, words=28_000)[1]
    assert len(json.dumps(small)) < 10_000 < 150_000 < len(json.dumps(big)) < 250_000
    shipped, edit = n_clusters({"gpu-a": [1], "gpu-b": [2], "gpu-c": [3]})
    assert set(shipped) == {"gpu-a", "gpu-b"}
    cfg: dict[str, Any] = {
        "static_resources": {
            "clusters": [{"name": "llm-extproc"}, {"name": "gpu-a"}, {"name": "gpu-b"}, {"name": "other"}],
            "listeners": [
                {
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "typed_config": {
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "routes": [
                                                        {"route": {"weighted_clusters": {"clusters": []}}}
                                                    ]
                                                }
                                            ]
                                        }
                                    }
                                }
                            ]
                        }
                    ]
                }
            ],
        }
    }
    edit(cfg)
    names = [c["name"] for c in cfg["static_resources"]["clusters"]]
    assert names == ["llm-extproc", "gpu-a", "gpu-b", "gpu-c"]  # added, and the unused one dropped
    gpu_c = cfg["static_resources"]["clusters"][-1]
    assert (
        gpu_c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
            "port_value"
        ]
        == 3
    )
