"""The overhead bench's do-nothing processor (extproc_lab.bench.null_processor), in the service's place
behind real Envoy: the shipped envoy.yaml's exchange (headers, then the buffered body) is answered and
every request reaches the cluster it names, so the bench's floor is a working processor."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from extproc_lab.bench.scenarios import MODEL, _service_config
from extproc_lab.bench.workers_overhead import NullProcess
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway


@pytest.mark.envoy
def test_the_do_nothing_processor_routes_every_request_to_its_cluster(tmp_path: Path) -> None:
    group = EngineGroup([0.0], MODEL)
    clusters = {"gpu-a": [group.ports[0]]}
    gw = LocalGateway(tmp_path, clusters=clusters, service=_service_config(clusters))
    gw.services = [NullProcess({}, gw.service.port, gw.service.log_path)]
    gw.service = gw.services[0]
    try:
        gw.start()
        body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        for _ in range(3):
            req = urllib.request.Request(
                gw.url + "/v1/chat/completions", body.encode(), {"content-type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
                assert json.loads(resp.read())["choices"]
        assert sum(e.stats.requests for e in group.engines) == 3, gw.logs()
        # and each request's access-log entry went to it, as the service's do
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "grpc_access_log.logs_written: 3" not in gw.envoy.admin(
            "/stats"
        ):
            time.sleep(0.05)
        stats = [x for x in gw.envoy.admin("/stats").splitlines() if "grpc_access_log" in x]
        assert any(x.endswith("logs_written: 3") for x in stats), stats
    finally:
        gw.stop()
        group.close()
