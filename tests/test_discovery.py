"""Endpoint discovery from Kubernetes EndpointSlices (extproc/discovery), against a fake API server
process that keeps the list/watch contract (tests/fake_kube_api.py), and through real Envoy."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import yaml
from gateway_stack import MODEL, Stack, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import config_from_dict
from extproc.discovery import PoolUpdater
from extproc.discovery.kubernetes import EndpointSliceWatcher, slice_endpoints
from extproc.fleet import RoutingMode
from extproc.lifecycle import RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.scheduling import plugin_name
from extproc.server import app
from extproc.settings import ConfigError, KubernetesDiscovery
from extproc.telemetry import Metrics
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import ENVOY_DIR, free_port, wait_port

TOKEN = "test-token-0123"
SELECTOR = "kubernetes.io/service-name=vllm"
LABELS = {"kubernetes.io/service-name": "vllm"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class KubeApi:
    """The fake API server as a child process, plus its test-control calls."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.log = (tmp / "fake-kube-api.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).parent / "fake_kube_api.py"),
                "--port",
                str(self.port),
                "--token",
                TOKEN,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_port("127.0.0.1", self.port)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def put(self, name: str, addresses: list[str], port: int, *, ready: bool | None = True) -> None:
        conditions = {} if ready is None else {"ready": ready}
        spec = {
            "labels": LABELS,
            "endpoints": [{"addresses": [a], "conditions": conditions} for a in addresses],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        }
        self._call("PUT", f"/_test/slices/{name}", spec)

    def delete(self, name: str) -> None:
        self._call("DELETE", f"/_test/slices/{name}")

    def compact(self, silent: dict[str, tuple[list[str], int]]) -> None:
        specs = {
            name: {
                "labels": LABELS,
                "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addrs],
                "ports": [{"name": "http", "port": port}],
            }
            for name, (addrs, port) in silent.items()
        }
        self._call("POST", "/_test/compact", specs)

    def stats(self) -> dict[str, int]:
        return dict(self._call("GET", "/_test/stats"))

    def discovery(self, cluster: str = "inference-pool", **extra: Any) -> dict[str, Any]:
        return {
            "kubernetes": {
                "cluster": cluster,
                "namespace": "inference",
                "label_selector": SELECTOR,
                "api_server": self.url,
                "token_file": str(self.token_file),
                "ca_file": None,
                "retry_max_s": 0.5,
                **extra,
            }
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeApi]:
    api = KubeApi(tmp_path)
    yield api
    api.stop()


def settings(kube: KubeApi, **extra: Any) -> KubernetesDiscovery:
    cfg = config_from_dict(picker_config([], discovery=kube.discovery(**extra)))
    assert cfg.discovery is not None and cfg.discovery.kubernetes is not None
    return cfg.discovery.kubernetes


def picker_config(endpoints: list[str], **overrides: Any) -> dict[str, Any]:
    return {
        "routing": "endpoint",
        "pool": {"clusters": [{"name": "inference-pool", "models": [MODEL], "endpoints": endpoints}]},
        **overrides,
    }


# -- parsing and configuration ------------------------------------------------------------------------
def test_slice_endpoints_takes_ready_ip_endpoints_and_the_right_port() -> None:
    obj = {
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
            {"addresses": ["10.0.0.3"]},  # no conditions: ready, by the API's rule
        ],
    }
    assert slice_endpoints(obj, None, "http") == ("10.0.0.1:8000", "10.0.0.3:8000")
    assert slice_endpoints(obj, None, None) == ("10.0.0.1:9090", "10.0.0.3:9090")  # first port
    assert slice_endpoints(obj, 7000, None) == ("10.0.0.1:7000", "10.0.0.3:7000")
    assert slice_endpoints(obj, None, "grpc") == ()  # no such port: nothing to route to
    v6 = {"addressType": "IPv6", "ports": [{"port": 80}], "endpoints": [{"addresses": ["fd00::1"]}]}
    assert slice_endpoints(v6, None, None) == ("[fd00::1]:80",)
    fqdn = {"addressType": "FQDN", "ports": [{"port": 80}], "endpoints": [{"addresses": ["a.example"]}]}
    assert slice_endpoints(fqdn, None, None) == ()


def test_discovery_configuration_is_checked() -> None:
    k8s = {"cluster": "inference-pool", "label_selector": SELECTOR, "api_server": "http://127.0.0.1:1"}
    cfg = config_from_dict(picker_config([], discovery={"kubernetes": k8s}))
    assert cfg.pool.mode is RoutingMode.ENDPOINT and cfg.pool.candidates(MODEL) == ()  # known, empty
    with pytest.raises(ConfigError, match="routing: endpoint"):
        config_from_dict(
            {
                "pool": {"clusters": [{"name": "inference-pool", "models": [MODEL]}]},
                "discovery": {"kubernetes": k8s},
            }
        )
    with pytest.raises(ConfigError, match=r"not in 'pool\.clusters'"):
        config_from_dict(picker_config([], discovery={"kubernetes": {**k8s, "cluster": "other"}}))
    with pytest.raises(ConfigError, match="'port' or 'port_name'"):
        config_from_dict(
            picker_config([], discovery={"kubernetes": {**k8s, "port": 80, "port_name": "http"}})
        )
    with pytest.raises(ConfigError, match="needs 'label_selector'"):
        config_from_dict(picker_config([], discovery={"kubernetes": {"cluster": "inference-pool"}}))
    with pytest.raises(ConfigError, match="unknown"):
        config_from_dict(picker_config([], discovery={"kubernetes": {**k8s, "selector": "x"}}))
    # Without discovery an endpoint-mode cluster still needs its endpoints listed.
    with pytest.raises(ConfigError, match="needs 'endpoints'"):
        config_from_dict(picker_config([]))


# -- list + watch against the fake API server ----------------------------------------------------------
async def test_watcher_follows_the_slices_and_lists_again_after_410(kube: KubeApi) -> None:
    reports: list[tuple[str, ...]] = []
    kube.put("vllm-a", ["10.0.0.1", "10.0.0.2"], 8000)
    watcher = EndpointSliceWatcher(settings(kube), lambda _c, eps: reports.append(eps))
    watcher.start()

    async def until(expected: tuple[str, ...]) -> None:
        for _ in range(200):
            if reports and reports[-1] == expected:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"never reported {expected}; reports: {reports}")

    try:
        await until(("10.0.0.1:8000", "10.0.0.2:8000"))
        assert watcher.synced
        kube.put("vllm-b", ["10.0.1.1"], 8000)  # ADDED on the open watch
        await until(("10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000"))
        kube.put("vllm-a", ["10.0.0.2"], 8000)  # a pod went away: MODIFIED
        await until(("10.0.0.2:8000", "10.0.1.1:8000"))
        kube.put("vllm-b", ["10.0.1.1"], 8000, ready=False)  # not ready: out
        await until(("10.0.0.2:8000",))
        # Changes the watch never carries, then the history is compacted: only a new list sees them.
        kube.compact({"vllm-b": (["10.0.1.1", "10.0.1.2"], 8000)})
        await until(("10.0.0.2:8000", "10.0.1.1:8000", "10.0.1.2:8000"))
        assert watcher.relists >= 1
        stats = kube.stats()
        assert stats["gone"] >= 1 and stats["lists"] >= 2
        kube.delete("vllm-a")  # and the watch resumed after the relist
        await until(("10.0.1.1:8000", "10.0.1.2:8000"))
        assert kube.stats()["unauthorized"] == 0
    finally:
        await watcher.stop()


async def test_a_wrong_token_reports_nothing_and_keeps_retrying(kube: KubeApi) -> None:
    kube.token_file.write_text("not-the-token")
    kube.put("vllm-a", ["10.0.0.1"], 8000)
    reports: list[tuple[str, ...]] = []
    watcher = EndpointSliceWatcher(settings(kube), lambda _c, eps: reports.append(eps))
    watcher.start()
    try:
        assert await asyncio.to_thread(wait_until, lambda: kube.stats()["unauthorized"] >= 2)
        assert reports == [] and not watcher.synced
        kube.token_file.write_text(TOKEN)  # a rotated token is read again on the next try
        assert await asyncio.to_thread(wait_until, lambda: reports == [("10.0.0.1:8000",)])
    finally:
        await watcher.stop()


def test_pool_updates_swap_whole_and_keep_the_model_known() -> None:
    cfg = config_from_dict(picker_config(["10.0.0.1:80"]))
    pool = cfg.pool
    update = PoolUpdater(pool)
    update("inference-pool", ("10.0.0.2:80", "10.0.0.3:80"))
    assert [u.address for u in pool.candidates(MODEL) or ()] == ["10.0.0.2:80", "10.0.0.3:80"]
    assert pool.set_endpoints("inference-pool", ["10.0.0.2:80", "10.0.0.3:80"]) is False  # unchanged
    update("inference-pool", ("not-an-ip:80",))  # refused whole: the pool keeps what it had
    assert [u.address for u in pool.candidates(MODEL) or ()] == ["10.0.0.2:80", "10.0.0.3:80"]


CHURN_PROFILE = {
    "filters": ["bounded-load", "lora-affinity"],
    "scorers": ["predicted-ttft", "prefix-affinity", "latency-ucb", "lora-affinity"],
    "picker": "weighted-round-robin",  # every endpoint gets picked: every plugin learns about each
}


def per_upstream_state(lc: RequestLifecycle) -> dict[str, set[str]]:
    """What the profiles' plugins and the lifecycle's state hold, by upstream id."""
    held: dict[str, set[str]] = {}
    for profile in {id(p): p for p in (*lc.config.profiles.values(), lc.fallback)}.values():
        for plugin in [*profile.filters, *(s for s, _ in profile.scorers), profile.picker]:
            name = plugin_name(plugin)
            parts = (plugin, getattr(plugin, "predictor", None))  # predicted-ttft's state is its predictor's
            for attr in ("_models", "_index", "_arms", "_slots", "_dropped", "_current"):
                for part in parts:
                    table = getattr(part, attr, None)
                    if isinstance(table, dict):
                        held.setdefault(f"{name}.{attr}", set()).update(table)
            calibration = getattr(plugin, "calibration", None)
            if calibration is not None:
                held.setdefault(f"{name}.calibration", set()).update(
                    (*calibration._ups, *calibration._ratios)
                )
            names = getattr(plugin, "_names", None)
            if names is not None:
                held.setdefault(f"{name}._seen", set()).update(names._seen)
    return held


def test_endpoints_discovery_removes_leave_no_plugin_state_behind() -> None:
    """Pods replaced one after another must not grow per-upstream state without bound: when discovery
    takes endpoints out of the pool, every plugin forgets them; state returns to the baseline."""
    kept = ["10.0.0.1:80", "10.0.0.2:80"]
    cfg = config_from_dict(
        picker_config(kept, scheduling={"profile": "churn", "profiles": {"churn": CHURN_PROFILE}})
    )
    lc = RequestLifecycle(cfg, Metrics([MODEL], ["inference-pool"]))
    head = parse_head(
        {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"},
        session_header="x-session-id",
        user_header="x-user-id",
        priority_header="x-llm-priority",
    )

    def serve(n: int, start: int) -> None:
        for i in range(start, start + n):
            text = f"tenant {i} asks a question long enough to be hashed in blocks " * 12
            body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
            lc.finish(lc.route(head, body), "response_end")

    serve(10, 0)
    baseline = per_upstream_state(lc)
    ids = {f"inference-pool/{a}" for a in kept}
    assert baseline["predicted-ttft._models"] == ids and baseline["prefix-affinity._index"] == ids
    update = PoolUpdater(cfg.pool)
    for generation in range(3):  # three rollouts, 30 pods each, the two old ones staying
        pods = tuple(f"10.1.{generation}.{i}:80" for i in range(30))
        update("inference-pool", (*pods, *kept))
        serve(120, 1000 * (generation + 1))
        grown = per_upstream_state(lc)
        assert len(grown["predicted-ttft._models"]) == 32 and len(grown["latency-ucb._arms"]) == 32
    update("inference-pool", tuple(kept))
    after = per_upstream_state(lc)
    assert all(held <= ids for held in after.values()), {k: len(v) for k, v in after.items()}
    assert after["predicted-ttft._models"] == after["latency-ucb._arms"] == ids
    serve(10, 9000)  # and routing goes on over the endpoints left
    assert all(held <= ids for held in per_upstream_state(lc).values())


# -- gRPC health services ---------------------------------------------------------------------------
async def health_of(port: int, names: tuple[str, ...]) -> dict[str, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        out = {}
        for name in names:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            out[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return out


NAMES = ("liveness", "readiness", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor", "")


async def test_health_services_mean_live_ready_and_able_to_pick(kube: KubeApi) -> None:
    cfg = config_from_dict(
        picker_config([], discovery=kube.discovery(), listen=f"127.0.0.1:{free_port()}", metrics_listen=None)
    )
    running = await app.start(cfg)

    async def until(expected: dict[str, str]) -> None:
        for _ in range(100):
            if await health_of(running.port, tuple(expected)) == expected:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{await health_of(running.port, tuple(expected))} != {expected}")

    picking = ("inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor", "")
    try:
        # Listed, but no endpoint yet: alive and ready, not able to pick.
        await until({"liveness": "SERVING", "readiness": "SERVING", **dict.fromkeys(picking, "NOT_SERVING")})
        kube.put("vllm-a", ["10.0.0.1"], 8000)
        await until(dict.fromkeys(NAMES, "SERVING"))
        await running.announce(0)  # SIGTERM: every name NOT_SERVING, and it stays so
        await asyncio.sleep(0.6)
        assert set((await health_of(running.port, NAMES)).values()) == {"NOT_SERVING"}
    finally:
        await running.drain(1)
        await running.close()


async def test_an_unreachable_api_server_is_not_able_to_pick() -> None:
    k8s = {
        "cluster": "inference-pool",
        "label_selector": SELECTOR,
        "api_server": f"http://127.0.0.1:{free_port()}",
    }
    cfg = config_from_dict(
        picker_config(
            ["10.0.0.9:80"],
            discovery={"kubernetes": k8s},
            listen=f"127.0.0.1:{free_port()}",
            metrics_listen=None,
        )
    )
    running = await app.start(cfg)
    try:
        await asyncio.sleep(0.3)
        found = await health_of(running.port, NAMES)
        # The YAML's endpoints are there, but discovery never synced: not trusted to pick yet.
        assert found == {
            "liveness": "SERVING",
            "readiness": "SERVING",
            "inference-extension": "NOT_SERVING",
            "envoy.service.ext_proc.v3.ExternalProcessor": "NOT_SERVING",
            "": "NOT_SERVING",
        }
    finally:
        await running.drain(1)
        await running.close()


# -- pods churn behind real Envoy: requests go only to the current endpoints ---------------------------


@pytest.mark.envoy
async def test_pods_churn_requests_follow_the_endpoint_slices(
    kube: KubeApi, engines: EngineGroup, make_stack: Callable[..., Stack]
) -> None:
    cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc-endpoint.yaml").read_text())
    cfg.pop("fleet")
    cfg["pool"]["clusters"][0]["endpoints"] = []
    cfg["discovery"] = kube.discovery()
    # Admission would queue a request for a model with no endpoint (then 429 queue_timeout): here the
    # picker's own answer is under test, the protocol's 503 for "no ready endpoint".
    cfg["admission"] = {"enabled": False}
    e0, e1 = engines.engines
    p0, p1 = engines.ports
    kube.put("vllm-0", ["127.0.0.1"], p0)  # each engine is its own "pod" with its own port
    # Envoy's cluster knows both engines (in a mesh: EDS from the same slices); the service decides.
    stack = make_stack(envoy_file="endpoint-picker.yaml", service=cfg, clusters={"inference-pool": [0, 1]})

    def discovered() -> float:
        return stack.metrics().get('llm_extproc_discovered_endpoints{cluster="inference-pool"}', -1)

    def events(kind: str) -> float:
        return stack.metrics().get(
            f'llm_extproc_discovery_events_total{{kind="{kind}",source="kubernetes"}}', 0
        )

    async with aiohttp.ClientSession() as s:

        async def spread(n: int = 12) -> Counter[str]:
            async def one(i: int) -> str:
                body = {**CHAT, "messages": [{"role": "user", "content": f"churn {i} " * 30}]}
                async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    return r.headers["x-sim-engine"]

            return Counter(await asyncio.gather(*(one(i) for i in range(n))))

        assert await asyncio.to_thread(wait_until, lambda: discovered() == 1)
        assert await spread() == {e0.name: 12}
        kube.put("vllm-1", ["127.0.0.1"], p1)  # scale up
        assert await asyncio.to_thread(wait_until, lambda: discovered() == 2)
        assert set(await spread()) == {e0.name, e1.name}
        kube.put("vllm-0", ["127.0.0.1"], p0, ready=False)  # e0's pod goes not-ready
        assert await asyncio.to_thread(wait_until, lambda: discovered() == 1)
        assert await spread() == {e1.name: 12}
        # e0 back, e1 gone, while the watch history is compacted: the service must relist (410).
        kube.compact({"vllm-0": (["127.0.0.1"], p0), "vllm-1": ([], p1)})
        assert await asyncio.to_thread(wait_until, lambda: events("relist") >= 1 and discovered() == 1)
        assert await spread() == {e0.name: 12}
        kube.delete("vllm-0")  # no pod at all: 503 from the service, nothing reaches an engine
        assert await asyncio.to_thread(wait_until, lambda: discovered() == 0)
        before = e0.stats.requests + e1.stats.requests
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503, await r.text()
            assert (await r.json())["error"]["code"] == "no_upstream"
        assert e0.stats.requests + e1.stats.requests == before
    assert wait_until(lambda: stack.inflight() == 0)


# -- the shipped manifests agree with discovery -------------------------------------------------------
def test_inference_extension_manifests_give_discovery_what_it_needs() -> None:
    folder = Path(__file__).parent.parent / "deploy" / "inference-extension"
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for f in folder.glob("*.yaml")
        for d in yaml.safe_load_all(f.read_text())
        if d and "kind" in d and d["kind"] != "Kustomization"
    }
    raw = yaml.safe_load(docs[("ConfigMap", "llm-extproc-epp-config")]["data"]["llm-extproc.yaml"])
    cfg = config_from_dict(raw)
    assert cfg.discovery is not None and cfg.discovery.kubernetes is not None
    k8s = cfg.discovery.kubernetes
    pool = docs[("InferencePool", k8s.cluster)]
    model_svc = docs[("Service", k8s.label_selector.partition("=")[2])]
    assert k8s.label_selector.partition("=")[0] == "kubernetes.io/service-name"
    # The headless Service selects the pool's pods on its target port, under the port name watched.
    assert model_svc["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    assert model_svc["spec"].get("clusterIP") == "None"
    (port,) = [p for p in model_svc["spec"]["ports"] if p["name"] == k8s.port_name]
    assert port["targetPort"] in {p["number"] for p in pool["spec"]["targetPorts"]}
    # The Deployment's ServiceAccount may list and watch EndpointSlices in that namespace.
    pod = docs[("Deployment", "llm-extproc-epp")]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    binding = next(d for (kind, _), d in docs.items() if kind == "RoleBinding")
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "llm"} in binding[
        "subjects"
    ]
    role = docs[("Role", binding["roleRef"]["name"])]
    assert any(
        "discovery.k8s.io" in r["apiGroups"]
        and "endpointslices" in r["resources"]
        and {"list", "watch"} <= set(r["verbs"])
        for r in role["rules"]
    )
    assert (
        model_svc["metadata"]["namespace"] == role["metadata"]["namespace"] == pool["metadata"]["namespace"]
    )
    # Startup must not wait for model pods (/healthz: liveness), readiness must (/serving: what the
    # ext_proc name's gRPC health says, over HTTP so it works with client certificates required).
    (container,) = pod["containers"]
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/serving"
